"""The overhead measurement's statistics, its instant backend and load generator (no timed
assertions: speed is measured by ``fairlane bench overhead``, not here)."""

from __future__ import annotations

import asyncio

from extproc.fleet.vllm_metrics import parse_metrics
from extproc.ops.processes import free_port
from loadtests.bench.overhead import backend, loadgen, phase


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
        await asyncio.sleep(0.2)
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
