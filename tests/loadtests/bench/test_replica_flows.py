"""Reading which replica decided which flow from real ``/metrics`` text."""

from __future__ import annotations

from loadtests.bench.replica_flows import flow_counts, placement, replica_flows
from tests.exported_metrics import gateway_exposition


def test_flow_counts_sum_each_flow_over_its_tiers() -> None:
    text = (
        "# HELP fairlane_flow_requests_total Admitted requests.\n"
        "# TYPE fairlane_flow_requests_total counter\n"
        'fairlane_flow_requests_total{tier="api",flow="power-a"} 7.0\n'
        'fairlane_flow_requests_total{tier="batch",flow="power-a"} 3.0\n'
        'fairlane_flow_requests_total{tier="api",flow="tenant-b"} 2.0\n'
    )
    assert flow_counts(text) == {"power-a": 10, "tenant-b": 2}


def test_a_real_gateways_exposition_names_its_flows() -> None:
    counts = flow_counts(gateway_exposition())
    assert counts and all(count > 0 for count in counts.values())


def test_each_replica_gets_its_own_counts() -> None:
    flows = replica_flows({"r1": gateway_exposition(), "r2": ""})
    assert flows["r1"] == flow_counts(gateway_exposition()) and flows["r2"] == {}


def test_placement_lists_each_replica_busiest_flow_first() -> None:
    flows = {"r2": {"tenant-b": 3, "power-a": 40}, "r1": {}}
    assert placement(flows) == "r1: nothing; r2: power-a 40, tenant-b 3"
