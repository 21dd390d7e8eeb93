"""The request path's counting: histogram buckets, bounded labels, what each event adds."""

from extproc.core.counters import OTHER, BoundedLabel, GatewayStats, Histogram


def test_histogram_buckets_are_upper_inclusive_and_cumulative() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    assert list(histogram.cumulative()) == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert histogram.count == 5 and abs(histogram.total - 8.65) < 1e-9


def test_bounded_label_keeps_the_first_values_and_folds_the_rest() -> None:
    label = BoundedLabel(2)
    assert [label(v) for v in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER, "a", OTHER, "b"]
    assert label.seen == {"a", "b"}


def test_admit_and_complete_feed_the_flow_shares_and_latencies() -> None:
    stats = GatewayStats()
    stats.admit("interactive", "llama", "acme", queued_s=0.2, tokens=100)
    stats.complete("interactive", "acme", duration_s=1.5, ttfb_s=0.3, output_tokens=40)
    stats.complete("interactive", "acme", duration_s=0.1, ttfb_s=None, output_tokens=0)
    assert stats.admitted == {("interactive", "llama"): 1}
    assert stats.flow_requests == {("interactive", "acme"): 1}
    assert stats.flow_tokens == {
        ("interactive", "acme", "input"): 100,
        ("interactive", "acme", "output"): 40,
    }
    assert stats.queue_wait.by_labels[("interactive",)].count == 1
    assert stats.request_duration.by_labels[("interactive",)].count == 2
    assert stats.time_to_first_byte.by_labels[("interactive",)].count == 1  # no byte, no TTFB


def test_models_and_flows_past_their_bounds_share_one_series() -> None:
    stats = GatewayStats(flow_label_limit=3, model_label_limit=2)
    for i in range(1000):
        stats.admit("api", f"model-{i}", f"tenant/user-{i}", queued_s=0.0, tokens=1)
    assert len(stats.admitted) == 3  # two models + other
    assert stats.admitted[("api", OTHER)] == 998
    assert len(stats.flow_requests) == 4
    assert stats.flow_requests[("api", OTHER)] == 997
