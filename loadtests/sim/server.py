"""The aiohttp application: vLLM's HTTP endpoints over one engine.

Per request the handler parses (``request``), logs (``--log-requests``), submits an
``EngineRequest`` to the runner, waits for it to finish and answers in vLLM's shapes
(``response``). Tokens do not travel through the handler: the runner calls the request's sink
once per token, and for streams the sink writes the pre-encoded SSE event straight to the
socket as one HTTP chunk, which keeps a token's cost at a few microseconds, so that one
process streams hundreds of requests. A handler is cancelled when its client disconnects,
and the request is aborted in the engine, freeing its seat and its KV blocks as vLLM does.
With ``--enable-lora`` a request's ``model`` may name a LoRA adapter (``loadtests.sim.lora``);
the engine limits the adapters in a batch and prices their loading.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from extproc.core.blockhash import HASH_ALGOS
from extproc.fleet.tokenizer import EngineTokenizer
from loadtests.sim.blocks import block_hashes, engine_hasher
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, Policy, StepOutput
from loadtests.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from loadtests.sim.lora import (
    LORA_NOT_ENABLED,
    MAX_LORA_RANKS,
    LoraModule,
    LoraRegistry,
    loaded_message,
    parse_load_body,
    parse_unload_body,
    runtime_updating_from_env,
    unloaded_message,
)
from loadtests.sim.metrics import CONTENT_TYPE, SimMetrics, cache_config_labels
from loadtests.sim.profiles import DEFAULT_PROFILE, get_profile
from loadtests.sim.request import (
    ApiError,
    GenerateRequest,
    PromptTokenizer,
    header_priority,
    parse_body,
    parse_generate,
)
from loadtests.sim.response import (
    VLLM_VERSION,
    ChunkTemplates,
    dumps,
    error_body,
    full_response,
    models_body,
    system_fingerprint,
)
from loadtests.sim.runner import Runner
from loadtests.sim.tokenize import tokenize_answer

FAULT_METRICS = (None, "garbage", "hang", "no-itl")
ITL_SERIES = b"vllm:inter_token_latency_seconds"
"""What ``--fault-metrics no-itl`` leaves out: every line of the histogram, HELP and TYPE too."""
# Binary junk, a half-written page and a series with a value that is not a number.
GARBAGE_METRICS = (
    b"<html>\x00\xff\xfe not a Prometheus exposition {{{\n"
    b'vllm:num_requests_waiting{engine="0"} banana\n'
    b"vllm:kv_cache_usage_perc 7e\x00\n"
)


@dataclass
class SimConfig:
    """Everything ``fairlane sim`` can be told; defaults follow vLLM's."""

    model: str = "sim-llama-8b"
    served_model_names: tuple[str, ...] = ()
    profile: str = DEFAULT_PROFILE
    speedup: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int = 0  # 0: the profile's
    block_size: int = 16
    max_model_len: int = 0  # 0: the profile's
    scheduling_policy: str = "fcfs"
    seed: int = 0
    log_requests: Path | None = None
    fault_delay_headers_s: float = 0.0
    """Fault injection: hold every generation request this many wall seconds before the
    engine sees it, so the response headers (streams too) come that much later."""
    fault_metrics: str | None = None
    """Fault injection: ``garbage`` answers ``/metrics`` with junk, ``hang`` never answers,
    ``no-itl`` leaves the inter-token latency histogram out (a vLLM without it, or a
    metrics filter in between: the gateway must still use the engine)."""
    api_key: str | None = None
    """vLLM's ``--api-key``: every ``/v1`` path answers 401 without ``Bearer <key>``."""
    kv_events_config: KVEventsConfig | None = None
    """vLLM's ``--kv-events-config``: publish the KV cache events over ZMQ."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM's ``--prefix-caching-hash-algo`` (``sha256`` or ``sha256_cbor``)."""
    tokenizer: Path | None = None
    """vLLM's ``--tokenizer`` (a model directory here): prompts are tokenized with its
    ``tokenizer.json`` and chat template (``extproc.fleet.tokenizer.EngineTokenizer``), not
    ``extproc.core.prompt``'s approximation."""
    enable_lora: bool = False
    """vLLM's ``--enable-lora``: requests may name a LoRA adapter as their ``model``."""
    lora_modules: tuple[LoraModule, ...] = ()
    """vLLM's ``--lora-modules``: adapters loaded at start-up (needs ``enable_lora``)."""
    max_loras: int = 1
    """vLLM's ``--max-loras``: distinct adapters in one batch (and GPU slots)."""
    max_lora_rank: int = 16
    """vLLM's ``--max-lora-rank``: checked against vLLM's choices, otherwise unused."""
    max_cpu_loras: int | None = None
    """vLLM's ``--max-cpu-loras``: checked (at least ``max_loras``), otherwise unused."""
    lora_load_ms: float = 50.0
    """The simulator's own: engine time (simulated ms) to bring an adapter into a slot."""
    runtime_lora_updating: bool | None = None
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; None: as
    ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` says (``1`` or ``true``), as vLLM reads it."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fault_delay_headers_s < 0:
            raise ValueError("fault_delay_headers_s must not be negative")
        if self.fault_metrics not in FAULT_METRICS:
            raise ValueError(f"fault_metrics must be one of {FAULT_METRICS}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora (vLLM cannot load them)")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}")
        # vLLM checks these in its LoRAConfig, which exists only with --enable-lora.
        if self.enable_lora and self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        cpu_loras = self.max_cpu_loras or 0  # vLLM: 0 or less is "as many as max_loras"
        if self.enable_lora and 0 < cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({cpu_loras}) must be >= max_loras ({self.max_loras})."
            )
        if self.lora_load_ms < 0:
            raise ValueError("lora_load_ms must not be negative")

    @property
    def served(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    def engine_config(self) -> EngineConfig:
        """The engine these flags describe (also what ``loadtests.des`` runs for a bench
        scenario's ``backends.flags``, so both read the flags one way)."""
        return EngineConfig(
            profile=get_profile(self.profile),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            policy=Policy(self.scheduling_policy),
            max_loras=self.max_loras if self.enable_lora else 0,
            lora_load_s=self.lora_load_ms / 1000,
        )


class StreamSink:
    """Writes one streaming request's tokens to its socket, one HTTP chunk per event."""

    __slots__ = ("done", "templates", "transport")

    def __init__(
        self, transport: asyncio.Transport, templates: ChunkTemplates, done: asyncio.Future[None]
    ) -> None:
        self.transport = transport
        self.templates = templates
        self.done = done

    def __call__(self, req: EngineRequest) -> None:
        if self.done.done():
            return
        transport = self.transport
        if transport.is_closing():
            self.done.set_exception(ConnectionResetError("client went away"))
            return
        index = req.num_output - 1
        if req.finish_reason is None:
            body = self.templates.token(index)
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        else:
            body = self.templates.last(index, req.finish_reason)
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            self.done.set_result(None)


UNAUTHORIZED = b'{"error":"Unauthorized"}'
"""vLLM's answer to a ``/v1`` request without its ``--api-key``."""
NOT_FOUND = b'{"detail":"Not Found"}'
"""FastAPI's 404 for a route vLLM did not add (the LoRA routes without runtime updating)."""


def _require_key(api_key: str) -> Any:
    """vLLM's ``--api-key`` check: only ``/v1`` paths, so ``/health`` and ``/metrics`` stay
    open to probes and scrapers; the key compared in constant time."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.Response(status=401, body=UNAUTHORIZED, content_type="application/json")
        response: web.StreamResponse = await handler(request)
        return response

    return require_key


def _finish_sink(done: asyncio.Future[None]) -> Any:
    def sink(req: EngineRequest) -> None:
        if req.finish_reason is not None and not done.done():
            done.set_result(None)

    return sink


class SimServer:
    """One simulated vLLM: engine, runner, metrics and the HTTP handlers."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine_config())
        self.max_model_len = self.engine.config.max_model_len
        self.metrics = SimMetrics(
            self.engine,
            config.served[0],
            cache_config_labels(self.engine, config.prefix_caching_hash_algo),
        )
        self.hasher = engine_hasher(config.prefix_caching_hash_algo)
        # The whole prompt is tokenized (no gateway-side cut): its length is the engine's.
        self.tokenizer: PromptTokenizer | None = (
            None
            if config.tokenizer is None
            else EngineTokenizer.from_dir(config.tokenizer, max_chars=None)
        )
        events = config.kv_events_config
        self.kv_events = events if events is not None and events.publishes else None
        self.kv_bind_host: str | None = None
        """Where a ``tcp://*`` KV events endpoint binds: the server's own host (``start``)."""
        self.publisher: KVEventPublisher | None = None
        on_step = self.metrics.on_step if self.kv_events is None else self._on_step
        if self.kv_events is not None:
            self.engine.pool.record_events()
        self.runner = Runner(self.engine, config.speedup, on_step)
        self._log: IO[str] | None = None
        self.fingerprint = system_fingerprint(config.served[0])
        self.loras = LoraRegistry(config.served)
        for module in config.lora_modules:  # loaded in order, as vLLM's init_static_loras
            try:
                adapter = self.loras.load(module.name, module.path, False, module.base_model_name)
            except ApiError as err:
                raise ValueError(err.message) from None
            self.engine.activate_lora(adapter.lora_id)
        self.runtime_lora = (
            runtime_updating_from_env()
            if config.runtime_lora_updating is None
            else config.runtime_lora_updating
        )

    # -- lifecycle --------------------------------------------------------------------------

    def app(self) -> web.Application:
        middlewares = [] if self.config.api_key is None else [_require_key(self.config.api_key)]
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        if self.config.fault_metrics is None:
            app.router.add_get("/metrics", self.metrics_handler)
        else:
            app.router.add_get("/metrics", self.faulty_metrics_handler)
        app.router.add_get("/version", self.version)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _: web.Application) -> None:
        if self.config.log_requests is not None:
            self._log = open(self.config.log_requests, "a", encoding="utf-8")  # noqa: SIM115
        if self.kv_events is not None:
            self.publisher = KVEventPublisher(self.kv_events, bind_host=self.kv_bind_host)
            self.publisher.start()
        self.runner.start()

    async def _cleanup(self, _: web.Application) -> None:
        await self.runner.stop()
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _on_step(self, out: StepOutput) -> None:
        """At a step's end, as vLLM's scheduler does after the model ran: the metrics, then
        the step's KV events as one batch (none when the step cached and evicted nothing)."""
        self.metrics.on_step(out)
        events = self.engine.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    # -- small endpoints --------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, _: web.Request) -> web.Response:
        return web.Response(body=dumps({"version": VLLM_VERSION}), content_type="application/json")

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        """vLLM's dev route (``VLLM_SERVER_DEV_MODE=1``): forget every cached block, refused
        (``success: false``) while a request holds one; ``AllBlocksCleared`` goes out with
        the next step's events, as vLLM's does. The bench empties caches between arms."""
        success = self.engine.pool.reset()
        return web.Response(body=dumps({"success": success}), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: the ids a generate request with this body would have
        (``loadtests.sim.tokenize``), for routers that match them against KV events."""
        try:
            body = parse_body(await request.read())
            answer = tokenize_answer(
                body, self.config.served, self.max_model_len, self.tokenizer, self.loras
            )
        except ApiError as err:
            return _error_response(err)
        return web.Response(body=dumps(answer), content_type="application/json")

    async def models(self, _: web.Request) -> web.Response:
        body = models_body(
            self.config.served, self.config.model, self.max_model_len, self.loras.cards()
        )
        return web.Response(body=body, content_type="application/json")

    # -- runtime LoRA updating --------------------------------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter``: its checks (400), then the engine's load,
        which fails (500) without ``--enable-lora``; the adapter goes into a GPU slot."""
        if not self.runtime_lora:
            return web.Response(status=404, body=NOT_FOUND, content_type="application/json")
        try:
            name, path, inplace = parse_load_body(parse_body(await request.read()))
            self.loras.check_load(name, path, inplace)
            if not self.config.enable_lora:
                self.loras.next_id()  # vLLM numbers the load before the engine refuses it
                raise ApiError(LORA_NOT_ENABLED, 500, "InternalServerError")
            adapter = self.loras.load(name, path, inplace)
        except ApiError as err:
            return _error_response(err)
        self.engine.activate_lora(adapter.lora_id)
        return web.Response(body=loaded_message(name), content_type="text/plain")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: the name is forgotten (its requests in
        flight go on; vLLM 0.32's frontend does not tell the engine)."""
        if not self.runtime_lora:
            return web.Response(status=404, body=NOT_FOUND, content_type="application/json")
        try:
            name = parse_unload_body(parse_body(await request.read()))
            self.loras.unload(name)
        except ApiError as err:
            return _error_response(err)
        return web.Response(body=unloaded_message(name), content_type="text/plain")

    async def metrics_handler(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def faulty_metrics_handler(self, _: web.Request) -> web.Response:
        """``--fault-metrics``: junk with a 200, no answer at all (until the client leaves),
        or the real page without its ITL histogram."""
        if self.config.fault_metrics == "hang":
            await asyncio.Event().wait()  # cancelled when the scraper gives up
        if self.config.fault_metrics == "no-itl":
            lines = self.metrics.exposition().splitlines(keepends=True)
            body = b"".join(line for line in lines if ITL_SERIES not in line)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
        return web.Response(body=GARBAGE_METRICS, content_type="text/plain")

    # -- generation -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        body: dict[str, Any] | None = None
        try:
            body = parse_body(await request.read())
            gen = parse_generate(
                chat,
                body,
                headers,
                self.config.served,
                self.max_model_len,
                self.config.seed,
                self.tokenizer,
                self.loras,
            )
        except ApiError as err:
            self._log_request(request.path, headers, body, None)
            if err.param == "model" and self.runtime_lora:
                self.loras.next_id()  # vLLM's resolve_lora takes an id before it gives up
            return _error_response(err)
        self._log_request(request.path, headers, body, gen)
        adapter = None if gen.lora_name is None else self.loras.get(gen.lora_name)
        if self.config.fault_delay_headers_s:
            # A slow backend: nothing reaches the engine (and no header leaves) before the
            # delay; a client leaving meanwhile cancels this handler with nothing to abort.
            await asyncio.sleep(self.config.fault_delay_headers_s)

        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        ereq = EngineRequest(
            request_id=gen.request_id,
            prompt_len=gen.prompt_len,
            block_hashes=block_hashes(
                gen.prompt_token_ids,
                self.engine.config.block_size,
                self.hasher,
                gen.cache_salt,
                None if adapter is None else (adapter.name, adapter.path),
            ),
            max_tokens=gen.max_tokens,
            output_len=gen.output_len,
            priority=gen.priority,
            params_max_tokens=gen.params_max_tokens,
            token_ids=gen.prompt_token_ids,
            cache_salt=gen.cache_salt,
            lora_id=0 if adapter is None else adapter.lora_id,
            lora_name=None if adapter is None else adapter.name,
        )
        created = int(time.time())
        response: web.StreamResponse | None = None
        try:
            if gen.stream:
                response = await self._open_stream(request, gen, created, ereq, done)
            else:
                ereq.sink = _finish_sink(done)
            self.runner.submit(ereq)
            await done
        finally:
            # A client that went away: aborted, its seat and blocks freed, and, as in vLLM
            # 0.32, not counted (its frontend drops the request's state, and with it the
            # finished-request stats: no request_success{finished_reason="abort"}).
            if ereq.finish_reason is None:
                self.runner.abort(ereq)
            if ereq.finish_reason == "abort":
                self.metrics.on_abort(ereq)
        if response is not None:
            await response.write_eof()
            return response
        assert ereq.finish_reason is not None
        payload = dumps(
            full_response(gen, ereq.num_output, ereq.finish_reason, created, self.fingerprint)
        )
        return web.Response(body=payload, content_type="application/json")

    async def _open_stream(
        self,
        request: web.Request,
        gen: GenerateRequest,
        created: int,
        ereq: EngineRequest,
        done: asyncio.Future[None],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        templates = ChunkTemplates(gen, created, self.fingerprint)
        await response.write(templates.first())  # also sends the headers
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("client went away")
        ereq.sink = StreamSink(transport, templates, done)
        return response

    def _log_request(
        self,
        path: str,
        headers: dict[str, str],
        body: dict[str, Any] | None,
        gen: GenerateRequest | None,
    ) -> None:
        if self._log is None:
            return
        body = body or {}
        record = {
            "time": time.time(),
            "request_id": gen.request_id if gen else None,
            "path": path,
            "model": body.get("model"),
            "priority": gen.priority if gen else None,
            "body_priority": gen.body_priority if gen else body.get("priority"),
            "header_priority": gen.header_priority if gen else header_priority(headers),
            "prompt_tokens": gen.prompt_len if gen else None,
            "max_tokens": gen.params_max_tokens if gen else body.get("max_tokens"),
            "stream": gen.stream if gen else bool(body.get("stream", False)),
            "headers": headers,
        }
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()


def _error_response(err: ApiError) -> web.Response:
    return web.Response(status=err.status, body=error_body(err), content_type="application/json")


SIM_KEY: web.AppKey[SimServer] = web.AppKey("sim", SimServer)


async def start(config: SimConfig, host: str, port: int) -> web.AppRunner:
    """Start a simulator listening on ``host:port``; ``await runner.cleanup()`` stops it."""
    server = SimServer(config)
    server.kv_bind_host = host
    app = server.app()
    app[SIM_KEY] = server
    app_runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await app_runner.setup()
    site = web.TCPSite(app_runner, host, port, backlog=2048, reuse_address=True)
    await site.start()
    return app_runner
