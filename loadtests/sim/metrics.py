"""vLLM 0.32's ``/metrics``, fed from engine steps.

Names, HELP texts, types, label sets and histogram buckets are copied from a real vLLM 0.32
dump (``shared/reference/vllm-0.32-metrics-sample.txt``), because the gateway and its
dashboards read them by name. Each server has its own ``CollectorRegistry`` (so two
simulators in one test process do not collide) and prometheus_client adds ``_total`` and
``_created`` exactly as it does for vLLM. Gauges are functions of the engine, so they are
current at scrape time; labels are printed in sorted order, as in vLLM's exposition. All
latencies are in simulated seconds, so a simulator sped up 10x still reports what the GPU
would have taken. With LoRA enabled, ``vllm:lora_requests_info`` is set as vLLM 0.32's
frontend sets it, which is not what its label names promise (``SimMetrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from loadtests.sim.engine import Engine, EngineRequest, StepOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


class _SortedLabels(Collector):
    """Re-yields another registry's metrics with labels in sorted order (``le`` included)."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            family.samples = [
                s._replace(labels=dict(sorted(s.labels.items()))) for s in family.samples
            ]
            yield family


class SimMetrics:
    """The metrics of one simulated server.

    With LoRA enabled, ``vllm:lora_requests_info`` is set as vLLM 0.32's Python frontend sets it
    (``LoRARequestStates``, ``PrometheusStatLogger``):

    - once per engine step, the series of the current label set is set to the wall clock
      (``set_to_current_time``); the series of earlier label sets stay, frozen at the time they
      were last current, so a reader takes the series with the largest value;
    - an adapter is listed from its request's first token to its last request's end (the
      frontend learns of QUEUED and SCHEDULED only with a request's first output), and
      ``running_lora_adapters`` and ``waiting_lora_adapters`` are the same list, because vLLM
      fills both from one dict of adapters with requests in flight; names are in the order the
      adapters entered it, comma-joined, ``""`` for none; ``max_lora`` is ``--max-loras``;
    - an idle engine takes no step, so the last series is not refreshed until the next one.
    """

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        cache_config: Mapping[str, str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = CollectorRegistry(auto_describe=True)
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR):
            self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        self.registry.register(_SortedLabels(self._metrics))

        reg = self._metrics
        base = ("engine", "model_name")
        lv = {"engine": "0", "model_name": model_name}
        max_len = engine.config.max_model_len

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, tuple(sorted(base + extra)), registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, tuple(sorted(base + extra)), registry=reg)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=tuple(buckets), registry=reg)

        pool = engine.pool
        gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            **lv
        ).set_function(lambda: engine.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            **lv
        ).set_function(lambda: engine.num_waiting)
        by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            ("reason",),
        )
        by_reason.labels(reason="capacity", **lv).set_function(
            lambda: engine.num_waiting - engine.num_deferred
        )
        by_reason.labels(reason="deferred", **lv).set_function(lambda: engine.num_deferred)
        sleep = gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            ("sleep_state",),
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(sleep_state=state, **lv).set(value)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(
            **lv
        ).set_function(lambda: pool.usage)

        mfu = "per GPU (for Model Flops Utilization calculations)."
        for name, doc in (
            ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations "),
            ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory "),
            ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory "),
        ):
            counter(name, doc + mfu).labels(**lv)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(**lv)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**lv)
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        ).labels(**lv)
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        ).labels(**lv)
        counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
        ).labels(**lv)
        counter(
            "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."
        ).labels(**lv)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**lv)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(**lv)
        by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        self.prompt_computed = by_source.labels(source="local_compute", **lv)
        self.prompt_cache_hit = by_source.labels(source="local_cache_hit", **lv)
        by_source.labels(source="external_kv_transfer", **lv)
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(**lv)
        cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            ("source",),
        )
        self.cached_device = cached_by_source.labels(source="device", **lv)
        for source in ("host", "p2p", "disk", "external_unspecified"):
            cached_by_source.labels(source=source, **lv)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**lv)
        success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.success = {r: success.labels(finished_reason=r, **lv) for r in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"),
            registry=reg,
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(model_name=model_name, reason=reason)

        self.req_prompt_tokens = hist(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets_1_2_5(max_len),
        ).labels(**lv)
        self.req_generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            buckets_1_2_5(max_len),
        ).labels(**lv)
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        ).labels(**lv)
        self.req_max_generation = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            buckets_1_2_5(max_len),
        ).labels(**lv)
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        ).labels(**lv)
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets_1_2_5(max_len),
        ).labels(**lv)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(**lv)
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(**lv)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        ).labels(**lv)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lv)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lv)
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lv)
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lv)
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**lv)
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTIONS_BUCKETS,
        ).labels(**lv)
        self.prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets_1_2_5(max_len),
        ).labels(**lv)
        info = {**cache_config, "engine": "0"}  # vLLM gives this one no model_name
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(sorted(info)),
            registry=reg,
        ).labels(**info).set(1)

        self._clock = clock
        self._lora_info: Gauge | None = None
        self._max_lora = str(engine.config.max_loras)
        self._lora_requests: dict[str, set[EngineRequest]] = {}
        """Adapter name -> its requests in flight that have had their first token."""
        if engine.config.max_loras:
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=reg,
            )

    def on_step(self, out: StepOutput) -> None:
        """Account one engine step: tokens, first tokens, inter-token gaps, finished requests."""
        if self._lora_info is not None:
            self._lora_step(out)
        self.iteration_tokens.observe(out.num_scheduled_tokens)
        if out.num_preemptions:
            self.preemptions.inc(out.num_preemptions)
        if out.prefix_queries:
            self.prefix_queries.inc(out.prefix_queries)
            self.prefix_hits.inc(out.prefix_hits)
        if not out.outputs:
            return
        self.generation_tokens.inc(len(out.outputs))
        itl = self.itl.observe
        for req in out.outputs:
            if req.num_output == 1:
                self._first_token(req)
            elif req.prev_token_at is not None and req.last_token_at is not None:
                itl(req.last_token_at - req.prev_token_at)
            if req.finish_reason is not None:
                self.on_finished(req)

    def _first_token(self, req: EngineRequest) -> None:
        assert req.first_token_at is not None
        self.ttft.observe(req.first_token_at - req.arrival)
        cached = req.num_cached_tokens
        self.prompt_tokens.inc(req.prompt_len)
        self.prompt_computed.inc(req.prompt_len - cached)
        if cached:
            self.prompt_cache_hit.inc(cached)
            self.prompt_cached.inc(cached)
            self.cached_device.inc(cached)

    def on_finished(self, req: EngineRequest) -> None:
        """Request-level histograms, observed once when a request ends (aborts included)."""
        reason = req.finish_reason or "error"
        self.success[reason].inc()
        end = req.finished_at if req.finished_at is not None else req.arrival
        scheduled = req.scheduled_at if req.scheduled_at is not None else end
        first = req.first_token_at if req.first_token_at is not None else end
        self.e2e.observe(end - req.arrival)
        self.queue_time.observe(scheduled - req.arrival)
        self.inference_time.observe(end - scheduled)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(end - first)
        self.req_prompt_tokens.observe(req.prompt_len)
        self.req_generation_tokens.observe(req.num_output)
        self.req_max_generation.observe(req.max_tokens)
        self.params_n.observe(1)
        if req.params_max_tokens is not None:
            self.params_max_tokens.observe(req.params_max_tokens)
        self.req_preemptions.observe(req.num_preemptions)
        self.prefill_kv_computed.observe(req.prompt_len - req.num_cached_tokens)
        if req.num_output > 1:
            self.tpot.observe((end - first) / (req.num_output - 1))

    def _lora_step(self, out: StepOutput) -> None:
        """The adapters with requests in flight after this step, stamped with the time."""
        tracked = self._lora_requests
        for req in out.outputs:
            name = req.lora_name
            if name is None:
                continue
            if req.num_output == 1:
                tracked.setdefault(name, set()).add(req)
            if req.finish_reason is not None:
                self._untrack(name, req)
        names = ",".join(tracked)
        assert self._lora_info is not None
        self._lora_info.labels(
            max_lora=self._max_lora, running_lora_adapters=names, waiting_lora_adapters=names
        ).set(self._clock())

    def _untrack(self, name: str, req: EngineRequest) -> None:
        requests = self._lora_requests.get(name)
        if requests is not None:
            requests.discard(req)
            if not requests:
                del self._lora_requests[name]

    def on_abort(self, req: EngineRequest) -> None:
        """A request the client left: out of the LoRA lists from the next step on."""
        if req.lora_name is not None:
            self._untrack(req.lora_name, req)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def cache_config_labels(engine: Engine, hash_algo: str = "sha256") -> dict[str, str]:
    """``vllm:cache_config_info`` labels, with the values this simulator actually uses."""
    c = engine.config
    tokens = c.num_gpu_blocks * c.block_size
    return {
        "_block_size_resolved": "True",
        "block_size": str(c.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(c.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / c.max_model_len, 2)),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(c.num_gpu_blocks),
        "num_gpu_blocks_override": str(c.num_gpu_blocks),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": hash_algo,
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }
