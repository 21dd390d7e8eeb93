"""The helpers the alert and dashboard cross-checks rest on: if these are wrong, so are they."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.metric_names import (
    ENVOY_EXT_PROC_PREFIX,
    ENVOY_EXT_PROC_STATS,
    PromQLSyntaxError,
    Selector,
    bad_matchers,
    envoy_exposition,
    envoy_sample_names,
    promql_metric_names,
    promql_selectors,
    sample_labels,
    sample_names,
    unknown_names,
    vllm_sample_names,
)

EXPOSITION = """\
# HELP q_depth Queue depth.
# TYPE q_depth gauge
q_depth{tier="a"} 1.0
# HELP reqs Requests.
# TYPE reqs counter
reqs_total{tier="a",reason="x"} 3.0
reqs_created{tier="a",reason="x"} 1.7e9
# HELP lat Latency.
# TYPE lat histogram
lat_bucket{le="0.1"} 1.0
lat_bucket{le="+Inf"} 2.0
lat_count 2.0
lat_sum 0.3
# TYPE ns:colon gauge
ns:colon 1.0
# TYPE envoy_rq_retry counter
envoy_rq_retry{cluster="b"} 0
# TYPE envoy_rq_total counter
envoy_rq_total{cluster="b"} 0
"""


def test_sample_names_are_the_stored_series_names() -> None:
    assert sample_names(EXPOSITION) == {
        "q_depth",
        "reqs_total",
        "reqs_created",
        "lat_bucket",
        "lat_count",
        "lat_sum",
        "ns:colon",
        # a counter declared without _total keeps its name, as Prometheus stores it
        "envoy_rq_retry",
        "envoy_rq_total",
    }


def test_sample_labels() -> None:
    labels = sample_labels(EXPOSITION)
    assert labels["reqs_total"] == {"tier": {"a"}, "reason": {"x"}}
    assert labels["lat_bucket"] == {"le": {"0.1", "+Inf"}}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ("vllm:num_requests_waiting > 3", {"vllm:num_requests_waiting"}),
        # aggregation with the label list before and after, functions, numbers
        (
            "histogram_quantile(0.99, sum by (tier, le) (rate(a_bucket[5m])))",
            {"a_bucket"},
        ),
        ("sum(rate(a_total[1h30m])) without (instance, job)", {"a_total"}),
        # label names in on()/ignoring()/group_left() are not metrics
        (
            "a > on (tier) group_left (slo, model) b * ignoring(le) c",
            {"a", "b", "c"},
        ),
        ("a * on(tier) group_right b", {"a", "b"}),
        # matchers: label names and values (even metric-like ones, commas, braces) skipped
        ('a{tier="b", reason=~"c|d", x!="e{f}", y!~`g"h`}', {"a"}),
        ('a{__name__!="b"}', {"a"}),
        ('{__name__="a", tier="x"}', {"a"}),
        # offset, @, subqueries, durations, scientific numbers, Inf/NaN, bool
        (
            "a offset 5m + b[10m:30s] @ 1609746000 > bool 1e3 + Inf - NaN + 0x1F + .5",
            {"a", "b"},
        ),
        ("max_over_time(deriv(a[10m])[1h:5m])", {"a"}),
        # strings as function arguments, with $1 and identifiers inside
        ('label_replace(a, "dst", "$1", "src_metric", "(.*)")', {"a"}),
        ('count_values("version", a)', {"a"}),
        ("topk(3, a) or bottomk(2, b) unless c and d", {"a", "b", "c", "d"}),
        ("quantile(0.9, a)", {"a"}),
        # Grafana variables in matchers, ranges and as whole terms
        (
            'sum by (tier) (rate(a_total{tier=~"$tier", backend=~"${backend:regex}"}'
            "[$__rate_interval])) / $__interval_ms",
            {"a_total"},
        ),
        ("rate(a_total[[[interval]]])", {"a_total"}),
        # comments
        ("a # b is a comment\n+ c", {"a", "c"}),
        # keywords are case-insensitive; a metric may share a prefix with a keyword
        ("a AND b OR sum_x + by_tier", {"a", "b", "sum_x", "by_tier"}),
        # a metric whose name is also a function's needs no parentheses to be a metric
        ("time_series_a + rate_b", {"time_series_a", "rate_b"}),
        ('absent(a{tier="batch"})', {"a"}),
        ("vector(1) + scalar(b) + time()", {"b"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_selectors_keep_their_matchers() -> None:
    sels = promql_selectors('rate(a_total{tier="x",reason=~"y|z"}[5m]) / b{le="+Inf"}')
    assert sels == [
        Selector("a_total", (("tier", "=", "x"), ("reason", "=~", "y|z"))),
        Selector("b", (("le", "=", "+Inf"),)),
    ]


def test_escaped_quotes_in_matchers() -> None:
    assert promql_selectors(r'a{x="say \"hi\", {ok}"}') == [
        Selector("a", (("x", "=", 'say "hi", {ok}'),))
    ]


@pytest.mark.parametrize("expr", ['a{x="unterminated}', "sum(a", 'a{x=y"}', '{x="no name"}'])
def test_malformed_expressions_are_errors_not_silence(expr: str) -> None:
    with pytest.raises(PromQLSyntaxError):
        promql_selectors(expr)


def test_unknown_names_reports_only_what_is_missing() -> None:
    known = sample_names(EXPOSITION)
    exprs = ["q_depth", "rate(reqs_total[5m])", "rate(reqs[5m])", "lat_bucket + lat"]
    assert unknown_names(exprs, known) == {"rate(reqs[5m])": {"reqs"}, "lat_bucket + lat": {"lat"}}
    assert unknown_names(["ALERTS{alertname='x'}"], known) == {}


def test_bad_matchers() -> None:
    labels = sample_labels(EXPOSITION)
    assert bad_matchers(['reqs_total{tier="a",reason=~"$r",job="j"}'], labels) == {}
    bad = bad_matchers(['reqs_total{tier="b"}', 'q_depth{tiers="a"}', "q_depth"], labels)
    assert set(bad) == {'reqs_total{tier="b"}', 'q_depth{tiers="a"}'}


def test_vllm_sample_names_are_vllm_032s() -> None:
    names = vllm_sample_names()
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:num_preemptions_total",
    ):
        assert name in names, name
    assert "vllm:gpu_cache_usage_perc" not in names


def test_vllm_exposition_matches_the_reference_dump() -> None:
    """The simulator exports exactly the vllm: series of the real vLLM 0.32 dump."""
    sample = Path(__file__).resolve().parents[2] / "tests/extproc/data/vllm-0.32-metrics.txt"
    if not sample.exists():
        pytest.fail(f"{sample} is missing")
    real = {n for n in sample_names(sample.read_text()) if n.startswith("vllm:")}
    ours = {n for n in vllm_sample_names() if n.startswith("vllm:")}
    assert real - ours == set(), "vLLM series the simulator does not export"


def test_envoy_ext_proc_stats_are_the_documented_ones() -> None:
    """The real Envoy's ext_proc stats under fairlane's stat prefix are the reference's list."""
    real = {
        n.removeprefix(ENVOY_EXT_PROC_PREFIX)
        for n in envoy_sample_names()
        if n.startswith(ENVOY_EXT_PROC_PREFIX)
    }
    assert real == ENVOY_EXT_PROC_STATS


def test_envoy_counters_keep_their_names() -> None:
    names = envoy_sample_names()
    assert "envoy_cluster_upstream_rq_retry" in names  # a counter without _total
    assert "envoy_cluster_upstream_rq_total" in names  # a counter whose name ends in it
    assert "envoy_cluster_upstream_rq_retry_total" not in names
    labels = sample_labels(envoy_exposition())["envoy_cluster_upstream_rq_retry"]
    assert labels["envoy_cluster_name"] == {"fairlane_backends", "fairlane_extproc"}
