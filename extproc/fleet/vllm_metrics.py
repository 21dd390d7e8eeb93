"""Read the few numbers admission needs from a vLLM ``/metrics`` page, cheaply.

The gateway scrapes every backend about ten times a second, so parsing must cost
microseconds, not the milliseconds a generic Prometheus parser spends on a 50 KB page of
histograms it does not need (docs/benchmarks/internals.md, ``python -m
loadtests.bench.micro``). ``parse_metrics`` runs one compiled regular expression whose
literal prefix (``\nvllm:``) lets the C regex engine skip to candidate lines; only the sample
lines of the series it uses are matched and converted. Every series is summed over its
``engine`` label values (data-parallel engines of one server), except KV-cache usage, a
fraction per engine, which is averaged. Only the waiting and running counts and KV-cache use
are required (without them an engine cannot be gated: ``MetricsError``); the ITL histogram
(whose ``_sum`` and ``_count`` give ``interval_itl``) and ``cache_config_info`` (block size
and count, for the picker's model of the prefix cache) are optional (``OPTIONAL``): a server
without them parses with ``None`` there, and only what they feed is switched off for it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
ITL = "vllm:inter_token_latency_seconds"
# vLLM before 0.11 exported the same histogram under this name (removed by 0.32).
LEGACY_ITL = "vllm:time_per_output_token_seconds"
CACHE_CONFIG = "vllm:cache_config_info"
OPTIONAL = {
    ITL: "its tiers' ITL bounds are off for it, and its seat count is not learned",
    CACHE_CONFIG: "its KV bounds read the scraped usage alone (no projection of the grants "
    "since), and its prefix model assumes the default block size",
}
"""The series a page may lack and still gate its engine (``EngineMetrics.absent``), and
what the gateway does without each: the operator reads it in the log line."""


class MetricsError(ValueError):
    """The page is not vLLM metrics: a required series is missing or a value is garbage."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of one backend, summed over its engines.

    ``itl_sum_s``/``itl_count`` are cumulative (since the server started); only the
    difference between two scrapes means anything (:func:`interval_itl`). Both are None
    when the page has no ITL histogram: zero would be a real count, and a later page that
    has it would read as tokens produced. ``scraped_at`` is the gateway's monotonic clock
    when the scrape was sent, so staleness is measured conservatively.
    """

    waiting: float
    running: float
    kv_cache_usage: float
    itl_sum_s: float | None
    itl_count: float | None
    scraped_at: float
    block_size: int | None = None
    """KV block size in tokens, from ``vllm:cache_config_info`` (None when not exported)."""
    num_gpu_blocks: int | None = None
    """KV blocks of all engines, from ``vllm:cache_config_info``: how much prefix the
    server can hold (None when not exported or not yet known)."""
    lora: LoraSlots | None = None
    """The engine's LoRA slots, from ``vllm:lora_requests_info`` (None without LoRA)."""

    @property
    def absent(self) -> tuple[str, ...]:
        """The optional series (:data:`OPTIONAL`) this page did not have, in that order:
        what the gates and the picker do without for this engine. A ``cache_config_info``
        without ``block_size`` counts as absent; one whose ``num_gpu_blocks`` is not known
        yet does not (vLLM sizes the cache after start-up)."""
        missing: tuple[str, ...] = () if self.itl_count is not None else (ITL,)
        return missing if self.block_size is not None else (*missing, CACHE_CONFIG)


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """Which LoRA adapters the engine's batch runs and which wait for a slot (vLLM keeps at
    most ``max_loras`` distinct adapters in a batch; swapping one in costs engine time)."""

    max_loras: int
    running: frozenset[str]
    waiting: frozenset[str]


# One C-level scan finds every sample line of the series above: ``\nNAME{labels} value`` or
# ``\nNAME value`` (an optional timestamp may follow). ``[{ \t]`` right after the name keeps
# ``vllm:num_requests_waiting_by_reason`` out of ``vllm:num_requests_waiting``; the label
# block runs to the last ``}`` of the line because label values may hold spaces or braces.
_SAMPLE = re.compile(
    r"\n(vllm:(?:num_requests_(?:waiting|running|waiting_by_reason)|kv_cache_usage_perc"
    r"|cache_config_info"
    r"|lora_requests_info"
    r"|(?:inter_token_latency|time_per_output_token)_seconds_(?:sum|count)))"
    r"(\{[^\n]*\})?[ \t]+([^ \t\n]*)"
)
# Inside ``vllm:cache_config_info``'s label block (a leading ``{`` or ``,`` keeps
# ``_block_size_resolved`` and ``num_gpu_blocks_override`` from matching).
_BLOCK_SIZE = re.compile(r'[{,]block_size="(\d+)"')
_NUM_GPU_BLOCKS = re.compile(r'[{,]num_gpu_blocks="(\d+)"')
_LORA_LABELS = re.compile(r'[{,](max_lora|running_lora_adapters|waiting_lora_adapters)="([^"]*)"')
LORA_INFO = "vllm:lora_requests_info"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_DEFERRED = re.compile(r'[{,]reason="deferred"')


def parse_metrics(text: str, scraped_at: float) -> EngineMetrics:
    """The admission-relevant numbers of a vLLM ``/metrics`` page; ``MetricsError`` if garbage."""
    values: dict[str, list[float]] = {}
    cache_configs: list[str] = []
    lora: tuple[float, str] | None = None
    deferred = 0.0
    for match in _SAMPLE.finditer("\n" + text):  # the leading newline lets line 1 match too
        if match[1] == CACHE_CONFIG:
            cache_configs.append(match[2] or "")
            continue
        if match[1] == WAITING_BY_REASON:
            if _DEFERRED.search(match[2] or ""):
                deferred += _number(WAITING_BY_REASON, match[3])
            continue
        if match[1] == LORA_INFO:  # one series per state; its value is when it was set
            stamp = _number(LORA_INFO, match[3])
            if lora is None or stamp > lora[0]:
                lora = (stamp, match[2] or "")
            continue
        values.setdefault(match[1], []).append(_number(match[1], match[3]))
    itl = LEGACY_ITL if LEGACY_ITL + "_count" in values and ITL + "_count" not in values else ITL
    itl_sum, itl_count = values.get(itl + "_sum"), values.get(itl + "_count")
    if not itl_sum or not itl_count:  # a histogram with only one of the two is no ITL either
        itl_sum = itl_count = None
    kv_values = _required(values, KV_CACHE_USAGE)
    kv = sum(kv_values) / len(kv_values)
    if kv > 1.0 + 1e-9:
        raise MetricsError(f"{KV_CACHE_USAGE} is {kv}, above 1")
    return EngineMetrics(
        # Requests vLLM defers (waiting for a LoRA slot, say) hold no seat and block no one:
        # the requests behind them are scheduled. Only the others are a queue to the gates
        # and to seat learning.
        waiting=max(0.0, sum(_required(values, WAITING)) - deferred),
        running=sum(_required(values, RUNNING)),
        kv_cache_usage=kv,
        itl_sum_s=None if itl_sum is None else sum(itl_sum),
        itl_count=None if itl_count is None else sum(itl_count),
        scraped_at=scraped_at,
        block_size=_block_size(cache_configs),
        num_gpu_blocks=_num_gpu_blocks(cache_configs),
        lora=None if lora is None else _lora_slots(lora[1]),
    )


def _lora_slots(labels: str) -> LoraSlots | None:
    """The newest ``vllm:lora_requests_info`` series' labels; None when malformed."""
    found = dict(_LORA_LABELS.findall(labels))
    try:
        max_loras = int(found.get("max_lora", ""))
    except ValueError:
        return None

    def names(key: str) -> frozenset[str]:
        return frozenset(n for n in found.get(key, "").split(",") if n)

    return LoraSlots(max_loras, names("running_lora_adapters"), names("waiting_lora_adapters"))


def _block_size(labels: list[str]) -> int | None:
    """The engines' KV block size (tokens); None when no engine reports one."""
    for block in labels:
        found = _BLOCK_SIZE.search(block)
        if found is not None and int(found[1]) > 0:
            return int(found[1])
    return None


def _num_gpu_blocks(labels: list[str]) -> int | None:
    """KV blocks over all engines of the server; None when none is known yet.

    vLLM reports ``None`` until its memory profiling has sized the cache.
    """
    total = 0
    for block in labels:
        found = _NUM_GPU_BLOCKS.search(block)
        if found is not None:
            total += int(found[1])
    return total or None


def interval_itl(previous: EngineMetrics | None, current: EngineMetrics) -> float | None:
    """Mean inter-token latency (s) of the tokens produced between two scrapes.

    None when there is no earlier scrape, when either page lacks the ITL histogram, when no
    token was produced in between, or when the counters went backwards (the server
    restarted).
    """
    if previous is None:
        return None
    count_before, count_now = previous.itl_count, current.itl_count
    sum_before, sum_now = previous.itl_sum_s, current.itl_sum_s
    if count_before is None or count_now is None or sum_before is None or sum_now is None:
        return None
    tokens = count_now - count_before
    seconds = sum_now - sum_before
    if tokens <= 0 or seconds < 0:
        return None
    return seconds / tokens


def _required(values: dict[str, list[float]], name: str) -> list[float]:
    found = values.get(name)
    if not found:
        raise MetricsError(f"{name} is missing (is this a vLLM /metrics page?)")
    return found


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise MetricsError(f"{name}: value {text[:40]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise MetricsError(f"{name}: value {value} is not a finite non-negative number")
    return value
