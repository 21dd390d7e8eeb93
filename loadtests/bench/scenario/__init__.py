"""The scenario file: what load to send, to which fleet, which arms to compare, what to check.

One concept per module:

- ``document``  the file as read (found by name or path, its node tree kept for lines)
- ``model``     the validated values (groups, arms, targets, the fleet) everything reads
- ``fields``    reading fields out of the node tree, every mistake as ``FILE:LINE: field``
- ``policy``    the policy a scenario names, ``default`` rescaled to the speedup
- ``groups``    reading the client groups and their token distributions
- ``parse``     validating a whole A/B scenario

(``kind: overhead`` files are read by :mod:`loadtests.bench.overhead.scenario`, with the
same reader.)
"""

from loadtests.bench.scenario.document import (
    SCENARIO_DIR,
    Document,
    ScenarioError,
    read_document,
    resolve,
)
from loadtests.bench.scenario.model import (
    ARM_KINDS,
    ARM_METRICS,
    ENVOY_ONLY_KINDS,
    LATENCY_METRICS,
    METRICS,
    RESERVED_ENGINE_FLAGS,
    RESERVED_SIM_FLAGS,
    Arm,
    Backends,
    Dist,
    EngineSetup,
    Group,
    Scenario,
    SharedPrefix,
    Target,
)
from loadtests.bench.scenario.parse import load_scenario, parse_document, parse_scenario
from loadtests.bench.scenario.policy import (
    DEFAULT_POLICY,
    is_default_policy,
    rescaled_policy_errors,
)

__all__ = [
    "ARM_KINDS",
    "ARM_METRICS",
    "DEFAULT_POLICY",
    "ENVOY_ONLY_KINDS",
    "LATENCY_METRICS",
    "METRICS",
    "RESERVED_ENGINE_FLAGS",
    "RESERVED_SIM_FLAGS",
    "SCENARIO_DIR",
    "Arm",
    "Backends",
    "Dist",
    "Document",
    "EngineSetup",
    "Group",
    "Scenario",
    "ScenarioError",
    "SharedPrefix",
    "Target",
    "is_default_policy",
    "load_scenario",
    "parse_document",
    "parse_scenario",
    "read_document",
    "rescaled_policy_errors",
    "resolve",
]
