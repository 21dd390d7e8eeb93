"""Reports and charges as Redis holds them: round trips, and bad bytes skipped."""

from __future__ import annotations

from extproc.core.peers import PeerBand, PreemptAsk, ReplicaReport
from extproc.fleet.shared_scrape import SharedScrape
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.state.codec import (
    decode_budget_charges,
    decode_charges,
    decode_report,
    decode_report_and_active,
    encode_budget_charges,
    encode_charges,
    encode_report,
    merge_charges,
)


def test_a_report_round_trips() -> None:
    report = ReplicaReport(
        "r1", {"10.0.0.1:8000": {0: 2, 2: 5}}, {"batch": PeerBand(7, 1.25)}, {"api": 3.5}
    )
    decoded = decode_report("r1", encode_report(report), age_s=0.1)
    assert decoded == ReplicaReport(
        "r1", report.in_flight, report.waiting, report.idle_s, age_s=0.1
    )


def test_a_band_head_and_shared_scrapes_round_trip() -> None:
    """The head's flow is what tells "another flow is owed" from "my own flow waits on
    another replica too"; a scrape's clock (``scraped_at``) does not travel, its age does."""
    metrics = EngineMetrics(3, 4, 0.5, 12.5, 400, scraped_at=71.5, block_size=16, num_gpu_blocks=9)
    report = ReplicaReport(
        "r1",
        waiting={
            "batch": PeerBand(7, 1.25, 30.0, "nightly"),
            "api": PeerBand(1, 0.5, 12.0, "light", head_fresh=True),
        },
        scrapes={
            "10.0.0.1:8000": SharedScrape(metrics, 0.05),
            "10.0.0.2:8000": SharedScrape(
                EngineMetrics(0, 0, 0.0, 0.0, 0, scraped_at=0.0), 0.2, ok=False
            ),
        },
    )
    decoded = decode_report("r1", encode_report(report), age_s=0.0)
    assert decoded == report


def test_a_scrape_without_the_itl_histogram_round_trips_as_unknown() -> None:
    metrics = EngineMetrics(3, 4, 0.5, None, None, scraped_at=71.5)
    report = ReplicaReport("r1", scrapes={"10.0.0.1:8000": SharedScrape(metrics, 0.05)})
    decoded = decode_report("r1", encode_report(report), age_s=0.0)
    assert decoded == report


def test_scrapes_no_engine_reports_are_refused() -> None:
    for row in (
        "[1, 0.1, true, -1, 4, 0.5, 1, 1, 16, 9]",
        "[1, 0.1, true, 1, 4, 1.5, 1, 1, 16, 9]",
        "[1, 0.1, true, 1, 4, 0.5, 1]",
        "[1, 0.1, true, 1, 4, 0.5, null, 1, 16, 9]",  # half a histogram
    ):
        assert decode_report("r1", '{"s": {"10.0.0.1:8000": ' + row + "}}", 0.0) is None


def test_a_tier_never_seen_is_left_out_of_the_report() -> None:
    report = ReplicaReport("r1", idle_s={"api": float("inf")})
    assert '"a":{}' in encode_report(report)


def test_unreadable_reports_and_charges_are_skipped() -> None:
    for text in ("not json", "[1, 2]", '{"i": {"b": {"x": 1}}}', '{"w": {"batch": [1]}}'):
        assert decode_report("r9", text, 0.0) is None
    assert decode_charges("{}") == []
    assert decode_charges('[["api", "acme"]]') == []


def test_charges_round_trip_and_accumulate() -> None:
    assert encode_charges({}) == ""
    ledger = {("api", "acme"): 10.0}
    merge_charges(ledger, [("api", "acme", 5.0), ("batch", "b", 1.0)])
    assert sorted(decode_charges(encode_charges(ledger))) == [
        ("api", "acme", 15.0),
        ("batch", "b", 1.0),
    ]


def test_budget_charges_and_requests_in_progress_round_trip() -> None:
    rows = [("acme", None, 150, 1), ("acme", "alice", -40, 0)]
    assert decode_budget_charges(encode_budget_charges(rows)) == rows
    assert encode_budget_charges([]) == "" and decode_budget_charges("") == []
    assert decode_budget_charges('[["acme", null, "x", 1]]') == []  # unreadable: skipped
    report = ReplicaReport("r1", {})
    text = encode_report(report, {("acme", None): 2, ("acme", "bob"): 1})
    decoded, active = decode_report_and_active("r1", text, 0.0)
    assert decoded == report
    assert active == {("acme", None): 2, ("acme", "bob"): 1}
    assert decode_report_and_active("r1", encode_report(report), 0.0)[1] == {}
    assert decode_report_and_active("r1", '{"b": [["acme"]]}', 0.0) == (None, {})


def test_cancellable_requests_and_asks_round_trip() -> None:
    asks = (PreemptAsk("r2", "10.0.0.1:8000", 0, 7),)
    report = ReplicaReport(
        "r1", cancellable={"10.0.0.1:8000": {2: 3, 1: 1}}, asks=asks, idle_s={"api": 1.0}
    )
    decoded = decode_report("r1", encode_report(report), age_s=0.0)
    assert decoded == report
    assert '"c"' not in encode_report(ReplicaReport("r1"))  # left out when empty


def test_kv_tokens_sent_round_trip() -> None:
    report = ReplicaReport("r1", kv_tokens={"10.0.0.1:8000": 123_456})
    assert decode_report("r1", encode_report(report), age_s=0.0) == report
    assert '"k"' not in encode_report(ReplicaReport("r1"))  # left out when none
    assert decode_report("r1", '{"k": {"10.0.0.1:8000": "x"}}', 0.0) is None
