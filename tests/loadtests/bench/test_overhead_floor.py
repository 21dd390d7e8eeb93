"""The transport's floor runs end to end through the real Envoy, on the service's gRPC server
and on grpc.aio, the reference it is measured against (numbers, not speed)."""

from __future__ import annotations

import pytest

from loadtests.bench.overhead.floor import SERVERS, run


@pytest.mark.parametrize("kind", SERVERS)
def test_the_floor_measures_a_trivial_servicer_behind_the_gateways_envoy(kind: str) -> None:
    figures = run(seconds=1.0, kind=kind, c1_requests=50)
    assert figures["errors"] == 0
    assert figures["saturation_rps"] > 0 and figures["service_cores"] > 0
    assert figures["rps_per_service_core"] > figures["saturation_rps"] / 4  # < 4 cores
    assert 0 < figures["c1_backend_p50_ms"] < figures["c1_p50_ms"]
