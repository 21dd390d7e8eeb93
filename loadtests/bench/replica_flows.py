"""Which replica decided which flow's requests, read from the replicas' own metrics.

With replicas, Envoy pins each client key's ext_proc streams to one replica by a Maglev hash
of the key over the replicas' addresses, and those are fresh ports each run: two runs of one
scenario can put the light tenants beside a heavy one or alone. A replica arm's figures mean
little without that placement, so the runner records it at the end of the load (before the
processes stop) from ``fairlane_flow_requests_total``, summed over tiers.
"""

from __future__ import annotations

from collections.abc import Mapping

from loadtests.bench.gateway_metrics import samples

FLOW_REQUESTS = "fairlane_flow_requests_total"

ReplicaFlows = dict[str, dict[str, int]]
"""replica id -> flow label -> requests it admitted."""


def flow_counts(exposition: str) -> dict[str, int]:
    """Admitted requests per flow in one replica's ``/metrics`` text, summed over tiers."""
    counts: dict[str, int] = {}
    for sample in samples(exposition, FLOW_REQUESTS):
        flow = sample.labels.get("flow", "")
        counts[flow] = counts.get(flow, 0) + int(sample.value)
    return counts


def replica_flows(expositions: Mapping[str, str]) -> ReplicaFlows:
    """Each replica's flow counts, from its exposition (``gateway_metrics.scrape_all``)."""
    return {replica: flow_counts(text) for replica, text in expositions.items()}


def placement(flows: ReplicaFlows) -> str:
    """One line: each replica and the flows it decided, most requests first."""
    parts = []
    for replica in sorted(flows):
        counts = sorted(flows[replica].items(), key=lambda kv: (-kv[1], kv[0]))
        listed = ", ".join(f"{flow} {count}" for flow, count in counts) or "nothing"
        parts.append(f"{replica}: {listed}")
    return "; ".join(parts)
