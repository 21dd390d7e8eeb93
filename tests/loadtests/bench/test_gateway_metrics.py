"""Reading the gateway's own counters at the end of an arm, from real ``/metrics`` text."""

from __future__ import annotations

from loadtests.bench.gateway_metrics import predicted_tokens, prefix_matches, scrape_all
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
    # the fixture's gateway routes without KV events: every grant is judged approximately
    text = gateway_exposition()
    assert prefix_matches([text]) == {"approximate": 3}
    assert set(predicted_tokens([text])) <= {"approximate"}


def test_predicted_tokens_are_read_by_index() -> None:
    text = (
        "# TYPE fairlane_prefix_predicted_tokens_total counter\n"
        'fairlane_prefix_predicted_tokens_total{backend="127.0.0.1:8701",index="precise"} 640.0\n'
        'fairlane_prefix_predicted_tokens_total{backend="127.0.0.1:8702",index="precise"} 0.0\n'
    )
    assert predicted_tokens([text, MATCHES]) == {"precise": 640}


def test_an_index_that_matched_nothing_is_left_out() -> None:
    zero = MATCHES.replace("40.0", "0.0").replace("2.0", "0.0")
    assert prefix_matches([zero]) == {"approximate": 3}


def test_a_process_that_does_not_answer_is_left_out() -> None:
    assert scrape_all({"r1": "http://127.0.0.1:9/metrics"}, timeout_s=0.5) == {}
