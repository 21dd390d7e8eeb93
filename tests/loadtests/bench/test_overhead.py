"""The overhead measurement's statistics, its instant backend and load generator, the
response classification and the recovery rule (no timed assertions: speed is measured by
``fairlane bench overhead``, not here)."""

from __future__ import annotations

import asyncio
import contextlib
import math

from extproc.core.errors import error_body
from extproc.fleet.vllm_metrics import parse_metrics
from extproc.ops.processes import free_port, port_open
from loadtests.bench.overhead import backend, loadgen, phase, rates
from loadtests.bench.overhead.loadgen import (
    CONNECTION_ERROR,
    ENVOY_ERROR,
    GATEWAY,
    OK,
    OTHER,
    TIMEOUT,
    Classified,
    Sample,
    classify,
)
from tests.polling import until


def _run(service_cpu: float | None = 2.0) -> phase.RunResult:
    run = phase.RunResult("rate", 100.0, 10.0, latencies_ms=[1.0] * 99 + [5.0])
    run.cpu_s = {"envoy": 1.0} if service_cpu is None else {"envoy": 1.0, "service": service_cpu}
    run.loadgen_cpu_s = 0.5
    run.machine_busy_fraction = 0.25
    run.late_ms = [0.5] * 100
    return run


def test_summarize_rates_and_cores() -> None:
    row = phase.summarize(_run())
    assert row["achieved_rps"] == 10.0
    assert row["p50_ms"] == 1.0 and row["p99_ms"] == 1.04  # interpolated, as in the A/B report
    assert row["cpu_cores"] == {"envoy": 0.1, "service": 0.2}
    assert row["loadgen_cores"] == 0.05
    assert row["rps_per_service_core"] == 50.0
    assert row["send_late_p99_ms"] == 0.5
    assert phase.summarize(_run(None))["rps_per_service_core"] is None


def test_added_latency_is_fairlane_minus_direct() -> None:
    direct = {"p50_ms": 0.3, "p99_ms": 0.9}
    assert phase.added_latency(direct, {"p50_ms": 0.8, "p99_ms": 2.4}) == {
        "p50_ms": 0.5,
        "p99_ms": 1.5,
    }
    assert phase.added_latency(direct, {"p50_ms": None, "p99_ms": 1.0})["p50_ms"] is None


def test_backend_metrics_page_parses_as_an_idle_engine() -> None:
    body = backend.ANSWERS[b"/metrics"].split(b"\r\n\r\n", 1)[1].decode()
    metrics = parse_metrics(body, 0.0)
    assert metrics.waiting == 0 and metrics.kv_cache_usage == 0
    assert metrics.block_size == 16


def test_generator_against_the_instant_backend() -> None:
    async def scenario() -> tuple[int, list[float], int]:
        port = free_port()
        server = asyncio.create_task(backend.serve_backend(port))
        await until(lambda: server.done() or port_open(port), "the backend to listen")
        try:
            gen = loadgen.LoadGenerator(port)
            status = await gen.one()
            latencies, errors = await gen.open_loop(rate=200, duration=0.1)
            assert len(gen.late_ms) == 20
            return status, latencies, errors
        finally:
            server.cancel()

    status, latencies, errors = asyncio.run(scenario())
    assert status == 200
    assert len(latencies) == 20 and errors == 0


def test_classify_tells_the_gateway_from_envoy() -> None:
    refusal = error_body(429, "tier interactive queue full", "queue_full")
    assert classify(200, b"{}") == OK and classify(204, b"") == OK
    assert classify(429, refusal) == GATEWAY
    assert classify(503, error_body(503, "queue deadline passed")) == GATEWAY
    # Envoy's own answers: ext_proc's status_on_error, an upstream overflow, a timeout
    assert classify(503, b"") == ENVOY_ERROR
    assert classify(503, b"upstream connect error or disconnect/reset before headers") == (
        ENVOY_ERROR
    )
    assert classify(504, b"upstream request timeout") == ENVOY_ERROR
    assert classify(500, refusal) == ENVOY_ERROR  # only 429/503 are refusals
    assert classify(503, b'{"error": "flat string"}') == ENVOY_ERROR
    assert classify(503, b"\xff\xfe") == ENVOY_ERROR
    assert classify(401, error_body(401, "no key")) == OTHER
    assert classify(429, b"slow down") == OTHER
    assert classify(0, b"") == CONNECTION_ERROR


def test_recovery_rule() -> None:
    assert phase.recovery_bound(2.0) == 3.0  # 1.5 x
    assert phase.recovery_bound(0.4) == 0.9  # + 0.5 ms
    bound = 3.0
    assert phase.recovery_time([50.0, 9.0, 2.0, 2.5, 2.9], 0.5, bound) == 1.0
    assert phase.recovery_time([2.0, 2.0], 0.5, bound) == 0.0
    # a good window followed by a bad one does not count: every later window must pass
    assert phase.recovery_time([2.0, 9.0, 2.0, 2.0], 1.0, bound) == 2.0
    assert phase.recovery_time([2.0, 2.0, 9.0], 0.5, bound) is None
    assert phase.recovery_time([2.0, None, 2.0], 0.5, bound) == 1.0  # nothing sent: not passed
    assert phase.recovery_time([], 0.5, bound) is None


def _sample(sent_s: float, latency_ms: float, outcome: str = OK, status: int = 200) -> Sample:
    return Sample(sent_s, outcome, status, latency_ms)


def test_window_p50_counts_failures_as_infinitely_slow() -> None:
    samples = [
        _sample(0.1, 1.0),
        _sample(0.2, 30.0, TIMEOUT, 0),
        _sample(0.3, 5.0, ENVOY_ERROR, 503),
        _sample(0.6, 1.0),
        _sample(0.7, 2.0),
        _sample(0.8, 900.0, TIMEOUT, 0),
        _sample(2.5, 1.0),  # after the watch: ignored
    ]
    p50s = phase.window_p50s(samples, 0.5, 1.5)
    assert p50s[0] == math.inf and p50s[1] == 2.0 and p50s[2] is None
    row = phase.summarize_recovery(
        Classified(samples=samples, elapsed_s=1.5), 100.0, 1.5, 0.5, 1.5, phase.Usage(1.5)
    )
    assert row["windows"] == [
        {"t_s": 0.0, "p50_ms": "failed"},
        {"t_s": 0.5, "p50_ms": 2.0},
        {"t_s": 1.0, "p50_ms": None},
    ]
    assert (row["bound_ms"], row["recovered"], row["recovery_s"]) == (2.25, False, None)
    assert row["rule"] == phase.RECOVERY_RULE
    assert (
        phase.summarize_recovery(
            Classified(samples=samples[:6], elapsed_s=1.0), 100.0, 1.5, 0.5, 1.0, phase.Usage(1.0)
        )["recovery_s"]
        == 0.5
    )
    # no baseline at that rate: no bound, never called recovered
    assert (
        phase.summarize_recovery(
            Classified(samples=samples, elapsed_s=1.0), 100.0, None, 0.5, 1.0, phase.Usage(1.0)
        )["recovered"]
        is False
    )


def test_summarize_overload_outcomes() -> None:
    samples = [_sample(0.1 * i, 2.0) for i in range(8)]  # 2xx, answered inside the second
    samples.append(_sample(0.95, 200.0))  # 2xx answered after the last send: not throughput
    samples += [_sample(0.5, 10.0, GATEWAY, 429), _sample(0.6, 80.0, GATEWAY, 503)]
    samples += [_sample(0.7, 3.0, ENVOY_ERROR, 503), _sample(0.8, 1.0, CONNECTION_ERROR, 0)]
    samples.append(_sample(0.9, 5000.0, TIMEOUT, 0))
    run = Classified(samples=samples, unsent=3, late_ms=[0.5] * 14, elapsed_s=1.0)
    usage = phase.Usage(1.0, {"service": 0.9}, 0.2, 0.95)
    row = phase.summarize_overload(run, 20.0, 10.0, 50.0, 512, usage)
    assert (row["sent"], row["unsent"], row["requests"], row["admitted_in_window"]) == (14, 3, 9, 8)
    assert row["achieved_rps"] == 8.0 and row["admitted_fraction"] == 0.8
    assert row["outcomes"] == {
        "ok": 9,
        "gateway": 2,
        "envoy_error": 1,
        "timeout": 1,
        "connection_error": 1,
        "other": 0,
    }
    assert row["statuses"] == {"0": 2, "200": 9, "429": 1, "503": 2}
    assert (row["gateway_p50_ms"], row["gateway_max_ms"]) == (45.0, 80.0)
    # 5 not admitted, 1 of them a gateway answer within 50 ms
    assert row["answered_within_fraction"] == 0.2
    assert (row["envoy_errors"], row["timeouts"]) == (2, 1)
    assert row["cpu_cores"] == {"service": 0.9} and row["machine_busy"] == 0.95
    nothing_refused = Classified(samples=samples[:8], elapsed_s=1.0)
    assert (
        phase.summarize_overload(nothing_refused, 20.0, 10.0, 50.0, 512, usage)[
            "answered_within_fraction"
        ]
        == 1.0
    )


def test_half_capacity_and_the_direct_arm_rates() -> None:
    assert rates.half_capacity(1357.0) == 678.0 and rates.half_capacity(None) is None
    assert rates.resolve_rates((100.0, "half_capacity"), 1357.0) == [
        (100.0, None),
        (678.0, "half_capacity"),
    ]
    assert rates.resolve_rates((100.0, "half_capacity"), None) == [(100.0, None)]
    assert rates.direct_rates((100.0, "half_capacity"), {"fairlane": 678.0, "b": 100.0}) == [
        (100.0, None),
        (678.0, "half_capacity of fairlane"),
    ]
    assert rates.direct_rates((100.0,), {"fairlane": 678.0}) == [(100.0, None)]


async def _silent_server(port: int, accepted: list[int]) -> asyncio.Server:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await reader.read()  # never answers; returns when the client drops the connection
        writer.close()

    return await asyncio.start_server(hold, "127.0.0.1", port)


def test_classified_loop_counts_timeouts_and_bounds_connections() -> None:
    async def scenario() -> tuple[Classified, int, list[int]]:
        port = free_port()
        accepted: list[int] = []
        server = await _silent_server(port, accepted)
        try:
            gen = loadgen.LoadGenerator(port, max_connections=3)
            run, pending = await gen.classified_loop(rate=100, duration=0.1, timeout=0.2)
            await loadgen.settle(pending, 5)
            return run, gen.open, accepted
        finally:
            server.close()

    run, still_open, accepted = asyncio.run(scenario())
    # 10 due, 3 connections: 3 sent and timed out, 7 not sent (all connections busy)
    assert (len(run.samples), run.unsent) == (3, 7)
    assert {s.outcome for s in run.samples} == {TIMEOUT}
    assert all(s.latency_ms >= 200 for s in run.samples)
    assert len(accepted) == 3 and still_open == 0  # a timed-out connection is dropped


def test_classified_loop_and_concurrency1_against_the_instant_backend() -> None:
    async def scenario() -> tuple[Classified, tuple[list[float], list[float], int]]:
        port = free_port()
        server = await asyncio.get_running_loop().create_server(
            backend._BackendProtocol, "127.0.0.1", port
        )
        try:
            gen = loadgen.LoadGenerator(port, max_connections=16)
            run, pending = await gen.classified_loop(rate=200, duration=0.1, timeout=5)
            await loadgen.settle(pending, 5)
            one = loadgen.LoadGenerator(port)
            c1 = await loadgen.concurrency1(one, loadgen.LoadGenerator(port), 5)
            return run, c1
        finally:
            server.close()

    run, (through, direct, errors) = asyncio.run(scenario())
    assert run.unsent == 0 and len(run.samples) == 20
    assert {(s.outcome, s.status) for s in run.samples} == {(OK, 200)}
    assert (len(through), len(direct), errors) == (5, 5, 0)


def test_several_keys_are_sent_in_turn() -> None:
    """Each request carries the next key: with replicas, Envoy pins each key to one, so the
    replica arms spread their load by sending many."""

    async def scenario() -> list[bytes]:
        seen: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while head := await reader.readuntil(b"\r\n\r\n"):
                    lines = head.split(b"\r\n")
                    seen.extend(line for line in lines if line.startswith(b"authorization:"))
                    length = next(
                        int(line.split(b":")[1])
                        for line in lines
                        if line.startswith(b"content-length:")
                    )
                    await reader.readexactly(length)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()

        port = free_port()
        server = await asyncio.start_server(answer, "127.0.0.1", port)
        try:
            gen = loadgen.LoadGenerator(port, api_key=("sk-a", "sk-b", "sk-c"))
            assert [await gen.one() for _ in range(5)] == [200] * 5
            gen.close()
        finally:
            server.close()
        return seen

    seen = asyncio.run(scenario())
    keys = [line.split(b"Bearer ")[1] for line in seen]
    assert keys == [b"sk-a", b"sk-b", b"sk-c", b"sk-a", b"sk-b"]
