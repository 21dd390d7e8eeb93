"""The many-models decision-cost benchmark runs, and its fleets route every request."""

from __future__ import annotations

import pytest

from extproc.core.decisions import Forward
from extproc.core.events import RequestInfo
from loadtests.bench.model_scale import CHAT, fleet, main, per_request_us


def test_every_request_of_the_many_model_fleet_goes_to_an_engine_of_its_model() -> None:
    gateway = fleet(models=5, engines_per_model=2)
    headers = {":method": "POST", ":path": CHAT, "authorization": "Bearer sk-chat-demo"}
    body = b'{"model": "model-3", "messages": [{"role": "user", "content": "hi"}]}'
    answer = gateway.handle(RequestInfo("POST", CHAT, headers, body, "r1")).answer
    assert isinstance(answer, Forward)
    serving = {b.address for b in gateway.admission.pool.serving("model-3")}
    assert set(answer.endpoints) <= serving and len(serving) == 2
    assert per_request_us(gateway, 5, 50) > 0


def test_the_benchmark_prints_both_fleets_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--requests", "20", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 model x 20 engines" in out and "50 models x 20 engines" in out and "ratio" in out
