"""The overhead bench's peer arms: which scenarios may run them, which targets judge them,
and the whole-gateway section that puts every arm beside them (from phase rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtests.bench.overhead.gateways import cpu_per_1000, gateway_figures, gateway_lines
from loadtests.bench.overhead.report import render_markdown
from loadtests.bench.overhead.scenario import (
    PEERS,
    OverheadScenario,
    OverheadTarget,
    parse_overhead,
)
from loadtests.bench.overhead.verdicts import evaluate
from loadtests.bench.scenario import Document, ScenarioError

POLICY = Path(__file__).resolve().parents[3] / "loadtests/scenarios/policies/overhead.yaml"


def row(mode: str, rate: float | None, p50: float, p99: float, **extra: Any) -> dict[str, Any]:
    base = {
        "mode": mode,
        "target_rps": rate,
        "achieved_rps": rate or 1000.0,
        "requests": 100,
        "errors": 0,
        "send_late_p99_ms": 1.0,
        "p50_ms": p50,
        "p99_ms": p99,
        "cpu_cores": {"envoy": 0.1, "backend": 0.05},
        "loadgen_cores": 0.05,
        "machine_busy": 0.3,
        "rps_per_service_core": None,
    }
    base.update(extra)
    return base


def c1(p50: float, p99: float, backend: tuple[float, float], cores: dict[str, float]) -> Any:
    return row(
        "concurrency1",
        None,
        p50,
        p99,
        achieved_rps=200.0,
        backend_p50_ms=backend[0],
        backend_p99_ms=backend[1],
        c1_added_p50_ms=round(p50 - backend[0], 3),
        cpu_cores=cores,
    )


def arms() -> dict[str, list[dict[str, Any]]]:
    fairlane = {"envoy": 0.1, "service": 0.25, "backend": 0.05}
    router = {"vllm-router": 0.07, "backend": 0.05}
    return {
        "fairlane": [
            row("rate", 100.0, 2.5, 6.0, cpu_cores=fairlane),
            c1(2.9, 9.0, (0.2, 0.5), {**fairlane, "service": 0.5}),
        ],
        "vllm-router": [
            row("rate", 100.0, 0.4, 1.2, cpu_cores=router),
            c1(0.3, 2.0, (0.2, 0.5), router),
        ],
        "direct": [
            row("rate", 100.0, 0.6, 1.5),
            row("backend", 100.0, 0.25, 0.8, cpu_cores={"envoy": 0.0, "backend": 0.05}),
        ],
    }


def test_every_arm_is_measured_against_the_backend_alone() -> None:
    figures = gateway_figures(arms(), [100.0])
    assert figures["vllm-router"]["processes"] == ["vllm-router"]
    assert figures["fairlane"]["processes"] == ["envoy", "service"]
    assert figures["vllm-router"]["concurrency1"] == {
        "added_p50_ms": 0.1,
        "added_p99_ms": 1.5,
        "cpu_s_per_1000": 0.35,  # 0.07 cores at 200 req/s
    }
    at_100 = figures["fairlane"]["rates"]["100"]
    assert (at_100["added_p50_ms"], at_100["added_p99_ms"]) == (2.25, 5.2)
    assert at_100["cpu_s_per_1000"] == 3.5  # (0.1 + 0.25) cores at 100 req/s
    assert figures["direct"]["rates"]["100"]["added_p50_ms"] == 0.35  # Envoy alone's own


def test_cpu_per_request_leaves_the_backend_out() -> None:
    assert cpu_per_1000(row("rate", 100.0, 1, 2, cpu_cores={"litellm": 2.3, "backend": 1})) == 23
    assert cpu_per_1000(row("rate", 100.0, 1, 2, achieved_rps=0)) is None


def test_cpu_per_request_of_one_process() -> None:
    cores = {"envoy": 0.2, "service": 0.5, "backend": 1}
    assert cpu_per_1000(row("rate", 100.0, 1, 2, cpu_cores=cores), "envoy") == 2
    assert cpu_per_1000(row("rate", 100.0, 1, 2, cpu_cores=cores), "service") == 5
    assert cpu_per_1000(row("rate", 100.0, 1, 2, cpu_cores=cores)) == 7


def test_the_report_puts_the_peers_beside_fairlane() -> None:
    lines = "\n".join(gateway_lines(arms(), [100.0]))
    assert "## The whole gateway, beside the peers" in lines
    assert "| vllm-router | vllm-router | 0.1 / 1.5 | 0.35 |" in lines
    assert "| 100 req/s | the backend alone | 0.25 / 0.8 | - | - | 0 |" in lines
    assert "| 100 req/s | fairlane | 2.5 / 6 | 2.25 / 5.2 | 3.5 | 0 |" in lines
    scenario = OverheadScenario(
        name="t",
        description="d",
        policy=POLICY,
        rates=(100.0,),
        duration_s=1.0,
        saturation_connections=0,
        warmup_requests=0,
        arms=("fairlane", "vllm-router", "direct"),
        targets=(OverheadTarget("p50", "added_p50_ms", 0.5, "max", 100.0),),
    )
    data = arms()
    targets = evaluate(scenario, data)
    assert [t.arm for t in targets] == ["fairlane"]  # a target never judges a peer
    markdown = render_markdown(
        {
            "scenario": {
                "description": "d",
                "path": "x.yaml",
                "policy": "p.yaml",
                "duration_s": 1.0,
                "warmup_requests": 0,
                "rates": [100.0],
                "run_order": list(scenario.run_order),
            },
            "meta": {"loadgen": "g", "backend": "b", "cpus": 2, "saturation_connections": 0},
            "arms": data,
            "failed_arms": {},
            "targets": [t.to_json() for t in targets],
        }
    )
    assert "peer gateways in place of Envoy and fairlane: vllm-router" in markdown
    # the phase table adds nothing over Envoy alone for a peer: it replaces Envoy
    assert "| 100 req/s | vllm-router | 100 | 0.4 | 1.2 | - | - |" in markdown
    assert "| 100 req/s | fairlane | 100 | 2.5 | 6 | 1.9 | 4.5 |" in markdown


def _document(**changes: Any) -> Document:
    data: dict[str, Any] = {
        "kind": "overhead",
        "name": "o",
        "policy": str(POLICY),
        "rates": [100],
        "duration_s": 1,
        "saturation_connections": 0,
    }
    data.update(changes)
    return Document(Path("o.yaml"), data)


def test_peers_run_only_when_named() -> None:
    assert parse_overhead(_document()).arms == ("direct", "fairlane")
    named = parse_overhead(_document(arms=["fairlane", *PEERS, "direct"]))
    assert named.run_order == ("fairlane", *PEERS, "direct")
    assert set(PEERS) <= set(named.all_arms)
    assert named.with_overrides(arms=["litellm", "direct"]).arms == ("direct", "litellm")


def test_a_fairlane_arm_may_not_take_a_peers_name() -> None:
    arms = {"litellm": {"policy": str(POLICY)}}
    with pytest.raises(ScenarioError, match="other than direct, vllm-router, litellm"):
        parse_overhead(_document(fairlane_arms=arms, policy=None))
