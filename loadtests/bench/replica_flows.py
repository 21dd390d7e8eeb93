"""Which replica decided which flow's requests, read from the replicas' own metrics.

With replicas, Envoy pins each client key's ext_proc streams to one replica by a Maglev hash
of the key over the replicas' addresses, and those are fresh ports each run: two runs of one
scenario can put the light tenants beside a heavy one or alone. A replica arm's figures mean
little without that placement, so the runner records it at the end of the load (before the
processes stop) from ``fairlane_flow_requests_total``, summed over tiers.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

FLOW_REQUESTS = "fairlane_flow_requests_total"

ReplicaFlows = dict[str, dict[str, int]]
"""replica id -> flow label -> requests it admitted."""


def flow_counts(exposition: str) -> dict[str, int]:
    """Admitted requests per flow in one replica's ``/metrics`` text, summed over tiers."""
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == FLOW_REQUESTS:
                flow = sample.labels.get("flow", "")
                counts[flow] = counts.get(flow, 0) + int(sample.value)
    return counts


def read_replica_flows(metrics_urls: Mapping[str, str], timeout_s: float = 5.0) -> ReplicaFlows:
    """Each replica's flow counts; a replica that does not answer is left out (it died, and
    the arm fails on that anyway)."""
    flows: ReplicaFlows = {}
    for replica, url in metrics_urls.items():
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                flows[replica] = flow_counts(response.read().decode())
        except OSError:
            continue
    return flows


def placement(flows: ReplicaFlows) -> str:
    """One line: each replica and the flows it decided, most requests first."""
    parts = []
    for replica in sorted(flows):
        counts = sorted(flows[replica].items(), key=lambda kv: (-kv[1], kv[0]))
        listed = ", ".join(f"{flow} {count}" for flow, count in counts) or "nothing"
        parts.append(f"{replica}: {listed}")
    return "; ".join(parts)
