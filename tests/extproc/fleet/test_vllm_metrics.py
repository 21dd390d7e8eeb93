from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.fleet.vllm_metrics import (
    CACHE_CONFIG,
    ITL,
    EngineMetrics,
    LoraSlots,
    MetricsError,
    interval_itl,
    parse_metrics,
)

SAMPLE = (Path(__file__).parents[1] / "data" / "vllm-0.32-metrics.txt").read_text()

WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:inter_token_latency_seconds_sum": "itl_sum_s",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}


def page(
    waiting: str = "0.0",
    running: str = "0.0",
    kv: str = "0.0",
    itl_sum: str = "0.0",
    itl_count: str = "0.0",
    engine: str = "0",
    itl: str = "vllm:inter_token_latency_seconds",
) -> str:
    labels = f'{{engine="{engine}",model_name="tiny"}}'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {running}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {waiting}\n"
        f'vllm:num_requests_waiting_by_reason{{engine="{engine}",reason="capacity"}} 99.0\n'
        f"vllm:kv_cache_usage_perc{labels} {kv}\n"
        f'{itl}_bucket{{engine="{engine}",le="+Inf",model_name="tiny"}} {itl_count}\n'
        f"{itl}_count{labels} {itl_count}\n"
        f"{itl}_sum{labels} {itl_sum}\n"
    )


def generic_parse(text: str) -> dict[str, float]:
    """The same numbers through prometheus_client's full parser, as a cross-check."""
    out = dict.fromkeys(WANTED.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED:
                out[WANTED[sample.name]] += sample.value
    return out


def test_the_real_vllm_032_dump_parses_to_what_a_full_parser_reads() -> None:
    metrics = parse_metrics(SAMPLE, scraped_at=12.5)
    assert metrics == EngineMetrics(
        waiting=0.0,
        running=0.0,
        kv_cache_usage=0.0,
        itl_sum_s=0.6315799129998823,
        itl_count=28.0,
        scraped_at=12.5,
        block_size=128,
        num_gpu_blocks=40,
    )
    full = generic_parse(SAMPLE)
    assert {field: getattr(metrics, field) for field in full} == full


def test_the_dump_with_load_values_still_matches_the_full_parser() -> None:
    loaded = (
        SAMPLE.replace('vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
                       'vllm:num_requests_running{engine="0",model_name="tiny"} 17.0')
        .replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0')
        .replace('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
                 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.625')
    )  # fmt: skip
    metrics = parse_metrics(loaded, 0.0)
    assert (metrics.waiting, metrics.running, metrics.kv_cache_usage) == (4.0, 17.0, 0.625)
    assert {f: getattr(metrics, f) for f in WANTED.values()} == generic_parse(loaded)


def test_engines_are_summed_and_kv_usage_averaged() -> None:
    text = page("2", "10", "0.5", "1.0", "10", engine="0") + page(
        "3", "6", "0.75", "2.0", "30", engine="1"
    )
    metrics = parse_metrics(text, 0.0)
    assert (metrics.waiting, metrics.running) == (5.0, 16.0)
    assert metrics.kv_cache_usage == pytest.approx(0.625)
    assert (metrics.itl_sum_s, metrics.itl_count) == (3.0, 40.0)


def test_unlabelled_lines_timestamps_odd_label_values_and_the_first_line() -> None:
    text = (
        "vllm:num_requests_waiting 2 1700000000000\n"  # first line of the page, no labels
        'vllm:num_requests_running{model_name="a } b",engine="0"} 3.0\n'
        "vllm:kv_cache_usage_perc\t0.25\r\n"
        "vllm:inter_token_latency_seconds_sum 1e-1\n"
        "vllm:inter_token_latency_seconds_count 4"
    )
    metrics = parse_metrics(text, 0.0)
    assert (metrics.waiting, metrics.running, metrics.kv_cache_usage) == (2.0, 3.0, 0.25)
    assert (metrics.itl_sum_s, metrics.itl_count) == (0.1, 4.0)


def cache_config(engine: str, block_size: str, num_gpu_blocks: str) -> str:
    return (
        f'vllm:cache_config_info{{_block_size_resolved="True",block_size="{block_size}",'
        f'engine="{engine}",num_gpu_blocks="{num_gpu_blocks}",'
        f'num_gpu_blocks_override="999"}} 1.0\n'
    )


def test_cache_config_gives_block_size_and_blocks_summed_over_engines() -> None:
    text = (
        page(engine="0")
        + cache_config("0", "16", "1000")
        + page(engine="1")
        + cache_config("1", "16", "500")
    )
    metrics = parse_metrics(text, 0.0)
    assert (metrics.block_size, metrics.num_gpu_blocks) == (16, 1500)


def test_cache_config_is_optional_and_unknown_values_stay_unknown() -> None:
    assert (parse_metrics(page(), 0.0).block_size, parse_metrics(page(), 0.0).num_gpu_blocks) == (
        None,
        None,
    )
    profiling = parse_metrics(page() + cache_config("0", "128", "None"), 0.0)
    assert (profiling.block_size, profiling.num_gpu_blocks) == (128, None)


def test_older_vllm_time_per_output_token_histogram_is_the_fallback() -> None:
    text = page(itl_sum="0.5", itl_count="5", itl="vllm:time_per_output_token_seconds")
    metrics = parse_metrics(text, 0.0)
    assert (metrics.itl_sum_s, metrics.itl_count) == (0.5, 5.0)


def without_itl(text: str) -> str:
    """``text`` with every line of the ITL histogram dropped, as a server that does not
    export it (or a metrics filter in between) serves it."""
    return "".join(line for line in text.splitlines(True) if ITL not in line)


def test_a_page_without_the_itl_histogram_parses_with_itl_unknown() -> None:
    metrics = parse_metrics(without_itl(SAMPLE), 3.0)
    assert (metrics.itl_sum_s, metrics.itl_count) == (None, None)
    assert (metrics.waiting, metrics.running, metrics.block_size) == (0.0, 0.0, 128)
    assert metrics.absent == (ITL,)
    assert parse_metrics(SAMPLE, 3.0).absent == ()


def test_half_an_itl_histogram_is_no_itl_either() -> None:
    for half in (page().replace("_count{", "_total{"), page().replace("_sum{", "_total{")):
        metrics = parse_metrics(half, 0.0)
        assert (metrics.itl_sum_s, metrics.itl_count) == (None, None)


def test_absent_names_each_optional_series_missing() -> None:
    assert parse_metrics(page(), 0.0).absent == (CACHE_CONFIG,)
    assert parse_metrics(without_itl(page()), 0.0).absent == (ITL, CACHE_CONFIG)
    # a cache vLLM has not sized yet is not a missing series
    assert parse_metrics(page() + cache_config("0", "16", "None"), 0.0).absent == ()


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "missing"),
        ("<html><body>502 Bad Gateway</body></html>", "missing"),
        (page().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "kv_cache"),
        (page(waiting="abc"), "not a number"),
        (page(running="NaN"), "finite"),
        (page(waiting="-1"), "non-negative"),
        (page(kv="+Inf"), "finite"),
        (page(kv="1.5"), "above 1"),
        (page(waiting=""), "not a number"),
    ],
)
def test_garbage_and_missing_series_raise(text: str, complaint: str) -> None:
    with pytest.raises(MetricsError, match=complaint):
        parse_metrics(text, 0.0)


def at(itl_sum: float, itl_count: float) -> EngineMetrics:
    return EngineMetrics(0, 1, 0.1, itl_sum, itl_count, 0.0)


def test_itl_is_the_mean_over_the_interval_between_two_scrapes() -> None:
    assert interval_itl(None, at(1.0, 10)) is None
    assert interval_itl(at(1.0, 10), at(1.6, 14)) == pytest.approx(0.15)
    assert interval_itl(at(1.0, 10), at(1.0, 10)) is None  # no token in between
    assert interval_itl(at(5.0, 100), at(0.2, 2)) is None  # counters reset: server restarted


def test_itl_is_unknown_when_either_scrape_lacks_the_histogram() -> None:
    absent = EngineMetrics(0, 1, 0.1, None, None, 0.0)
    assert interval_itl(at(1.0, 10), absent) is None
    assert interval_itl(absent, at(1.6, 14)) is None  # not 14 tokens "since" nothing
    assert interval_itl(absent, absent) is None


def test_lora_slots_come_from_the_newest_lora_requests_info_series() -> None:
    text = page() + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="ad1",'
        'waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="ad1,ad2",'
        'waiting_lora_adapters="ad3"} 1.8e9\n'
    )
    slots = parse_metrics(text, 0.0).lora
    assert slots == LoraSlots(2, frozenset({"ad1", "ad2"}), frozenset({"ad3"}))
    assert parse_metrics(page(), 0.0).lora is None  # no LoRA: no slots


def test_requests_vllm_defers_are_no_queue_to_the_gates() -> None:
    deferred = 'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"}'
    text = page(waiting="5.0") + f"{deferred} 3.0\n"
    assert parse_metrics(text, 0.0).waiting == 2.0  # 3 wait for a LoRA slot, not a seat
    assert parse_metrics(page(waiting="5.0"), 0.0).waiting == 5.0  # only capacity given
