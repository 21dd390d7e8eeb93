"""The policy a scenario names: a file next to the scenario, or ``default``.

``policy: default`` is fairlane's shipped policy with every duration divided by the run's
speedup (:mod:`loadtests.bench.policy_scale`), so it means on the simulated fleet what it
means on real engines. It is validated rescaled too, and a problem that only the rescaling
causes is reported on the line of the file a person edits, not of the generated copy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from extproc.yamlfile import YamlSyntaxError, compose, line_of
from loadtests.bench.scenario.fields import FieldReader, Section, text

DEFAULT_POLICY = "default"
"""``policy: default``: fairlane's shipped policy, rescaled to the scenario's speedup."""


def is_default_policy(raw: Any) -> bool:
    """Whether a scenario's ``policy`` value names the shipped default (not a file)."""
    return isinstance(raw, str) and raw.strip() == DEFAULT_POLICY


def rescaled_policy_errors(source: Path, speedup: float) -> list[str]:
    """What is wrong with ``source`` rescaled for ``speedup`` (nothing, for a valid source
    at any sane speedup), each problem as ``SOURCE:LINE: field: message``: the line of the
    field in the file a person edits, not in the generated copy."""
    from extproc.policy import PolicyError, parse_policy
    from loadtests.bench.policy_scale import render_scaled_policy

    name = f"{source} (rescaled x{speedup:g})"
    try:
        parse_policy(render_scaled_policy(source, speedup), name)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return [f"{source}: cannot rescale: {exc}"]
    except PolicyError as exc:
        try:
            node = compose(source.read_text(encoding="utf-8"), str(source))
        except (OSError, YamlSyntaxError):
            node = None
        problems = []
        for error in exc.errors:
            rest = error.removeprefix(f"{name}:").partition(": ")[2]
            field = rest.partition(": ")[0]
            line = line_of(node, field) if re.fullmatch(r"[\w.\[\]-]+", field) else None
            at = f"{source}:{line}" if line is not None else str(source)
            problems.append(f"{at}: {rest} (after dividing its durations by {speedup:g})")
        return problems
    return []


def read_policy(reader: FieldReader, top: Section, speedup: float | None = None) -> Path:
    """The policy file: ``default`` is fairlane's shipped policy
    (``extproc.policy.DEFAULT_POLICY_PATH``), also validated rescaled for ``speedup``
    when one is given (the A/B scenarios: the gateway reads it that way); anything else
    a file relative to the scenario file, used as written (in wall-clock seconds)."""
    raw = reader.get(top, "policy", text, "the path of a policy YAML, or default")
    if raw is None:
        return Path()
    from extproc.policy import DEFAULT_POLICY_PATH, PolicyError, load_policy

    default = is_default_policy(raw)
    path = DEFAULT_POLICY_PATH if default else Path(raw)
    if not path.is_absolute():
        path = reader.path.parent / path
    if not path.is_file():
        reader.error_in(top, "policy", f"no such file {path}")
        return path
    try:
        load_policy(path)
    except PolicyError as exc:
        reader.error_in(top, "policy", f"{path} is not a valid policy:\n{exc}")
        return path
    if default and speedup is not None:
        problems = rescaled_policy_errors(path, speedup)
        if problems:
            reader.error_in(
                top,
                "policy",
                f"{path} rescaled for speedup {speedup:g} is not a valid policy:\n"
                + "\n".join(problems),
            )
    return path
