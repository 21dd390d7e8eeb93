"""Reading the gateway's own counters at the end of an arm, from real ``/metrics`` text."""

from __future__ import annotations

from loadtests.bench.gateway_metrics import prefix_matches, scrape_all
from tests.exported_metrics import gateway_exposition

MATCHES = (
    "# TYPE fairlane_prefix_matches_total counter\n"
    'fairlane_prefix_matches_total{backend="127.0.0.1:8701",index="precise"} 40.0\n'
    'fairlane_prefix_matches_total{backend="127.0.0.1:8702",index="precise"} 2.0\n'
    'fairlane_prefix_matches_total{backend="127.0.0.1:8702",index="approximate"} 3.0\n'
)


def test_prefix_matches_sum_over_backends_and_processes() -> None:
    assert prefix_matches([MATCHES, MATCHES]) == {"approximate": 6, "precise": 84}


def test_a_real_gateways_exposition_counts_its_matches() -> None:
    # the fixture's gateway routes without KV events: every match is approximate
    assert prefix_matches([gateway_exposition()]) == {"approximate": 3}


def test_an_index_that_matched_nothing_is_left_out() -> None:
    zero = MATCHES.replace("40.0", "0.0").replace("2.0", "0.0")
    assert prefix_matches([zero]) == {"approximate": 3}


def test_a_process_that_does_not_answer_is_left_out() -> None:
    assert scrape_all({"r1": "http://127.0.0.1:9/metrics"}, timeout_s=0.5) == {}
