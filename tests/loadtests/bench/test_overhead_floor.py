"""The transport's floor runs end to end through the real Envoy, on the service's gRPC server,
on grpc.aio (the reference it is measured against) and with Envoy alone (numbers, not
speed)."""

from __future__ import annotations

import pytest

from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.params import EnvoyParams
from extproc.wire import EXT_PROC_FILTER
from loadtests.bench.overhead.floor import DIRECT, SERVERS, run, trimmed


@pytest.mark.parametrize("kind", SERVERS)
def test_the_floor_measures_a_trivial_servicer_behind_the_gateways_envoy(kind: str) -> None:
    figures = run(seconds=1.0, kind=kind, c1_requests=300)
    assert figures["errors"] == 0
    saturation, cores = figures["saturation_rps"], figures["service_cores"]
    assert saturation is not None and saturation > 0 and cores is not None and cores > 0
    per_core = figures["rps_per_service_core"]
    assert per_core is not None and per_core > saturation / 4  # < 4 cores
    backend, through = figures["c1_backend_p50_ms"], figures["c1_p50_ms"]
    assert backend is not None and through is not None and 0 < backend < through
    envoy, servicer = figures["c1_envoy_cpu_s_per_1000"], figures["c1_floor_cpu_s_per_1000"]
    assert envoy is not None and servicer is not None and envoy > 0 and servicer > 0
    assert figures["c1_cpu_s_per_1000"] == pytest.approx(envoy + servicer, abs=0.01)


def test_the_floor_measures_envoy_alone_too() -> None:
    figures = run(seconds=1.0, kind=DIRECT, c1_requests=300)
    assert figures["errors"] == 0 and "service_cores" not in figures
    envoy = figures["c1_envoy_cpu_s_per_1000"]
    assert envoy is not None and envoy > 0 and figures["c1_cpu_s_per_1000"] == envoy


def test_trimmed_leaves_out_the_body_message_and_the_access_log() -> None:
    params = EnvoyParams(extproc_port=9001)
    whole = trimmed(render_bootstrap(params), headers_only=False, access_log=True)
    assert whole == render_bootstrap(params)
    trim = trimmed(render_bootstrap(params), headers_only=True, access_log=False)
    hcm = trim["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert "access_log" not in hcm["typed_config"]
    (ext_proc,) = [f for f in hcm["typed_config"]["http_filters"] if f["name"] == EXT_PROC_FILTER]
    assert ext_proc["typed_config"]["processing_mode"]["request_body_mode"] == "NONE"


def test_the_floor_runs_with_one_message_a_request_and_no_access_log() -> None:
    figures = run(seconds=0.5, kind="h2", c1_requests=300, headers_only=True, access_log=False)
    assert figures["errors"] == 0
    servicer = figures["c1_floor_cpu_s_per_1000"]
    assert servicer is not None and servicer > 0
