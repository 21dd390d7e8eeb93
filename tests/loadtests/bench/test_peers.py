"""The peer arms' command lines, configs and client styles, without starting anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.fleet.backend import BackendSpec, KVEventPorts
from extproc.ops.processes import ProcessGroup
from loadtests.bench.arms import SCHEDULING
from loadtests.bench.cpu import CpuUsage
from loadtests.bench.peers import start as start_module
from loadtests.bench.peers import vllm_router as router_module
from loadtests.bench.peers.install import LITELLM, VLLM_ROUTER, PeerMissing, missing_reason, require
from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.peers.litellm import (
    MASTER_KEY,
    litellm_argv,
    litellm_config,
    litellm_priority,
)
from loadtests.bench.peers.report import peer_lines
from loadtests.bench.peers.served import DEFAULT_BLOCK_SIZE, block_size_in
from loadtests.bench.peers.start import start_peer
from loadtests.bench.peers.vllm_router import KvSources, router_argv
from loadtests.bench.request_style import request_style
from loadtests.bench.results import ArmResult
from loadtests.bench.scenario import SCENARIO_DIR, load_scenario, parse_scenario
from loadtests.bench.scenario.model import PEER_KINDS
from loadtests.bench.stats import arm_summary

POLICY = SCENARIO_DIR / "policies" / "bench-x20.yaml"
ENGINES = (
    BackendSpec("127.0.0.1", 8001, kv_events=KVEventPorts(5557, 5558)),
    BackendSpec("127.0.0.1", 8002, kv_events=KVEventPorts(5559)),
)


def test_every_peer_kind_has_its_gateway_and_engine_policy() -> None:
    assert tuple(PEER_ARMS) == PEER_KINDS
    # Priorities sent: the engines order by them; none sent: vLLM's default.
    for kind, arm in PEER_ARMS.items():
        expected = "fcfs" if arm.priority == "none" else "priority"
        assert SCHEDULING[kind] == expected, kind
    assert [a.kind for a in PEER_ARMS.values() if a.kv_events] == ["vllm-router-kv"]


# --------------------------------------------------------------------------- install


def test_a_missing_peer_says_how_to_install_it(tmp_path: Path) -> None:
    reason = missing_reason(VLLM_ROUTER, tmp_path)
    assert reason is not None
    assert "scripts/setup-peers" in reason and "'vllm-router==0.1.17'" in reason
    with pytest.raises(PeerMissing, match="setup-peers"):
        require(LITELLM, tmp_path)


def test_a_failed_install_is_reported_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "peers").mkdir()
    (tmp_path / "peers" / "litellm.error").write_text("pip install failed: no network\n")
    reason = missing_reason(LITELLM, tmp_path)
    assert reason is not None and "no network" in reason and "litellm[proxy]==1.108.7" in reason


def test_an_installed_peer_needs_its_pinned_version(tmp_path: Path) -> None:
    binary = VLLM_ROUTER.binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    stamp = VLLM_ROUTER.venv(tmp_path) / ".fairlane-peer-installed"
    stamp.write_text("vllm-router==0.1.16\n")
    assert "0.1.16" in (missing_reason(VLLM_ROUTER, tmp_path) or "")
    stamp.write_text("vllm-router==0.1.17\n")
    assert missing_reason(VLLM_ROUTER, tmp_path) is None
    assert require(VLLM_ROUTER, tmp_path) == binary


# --------------------------------------------------------------------------- vllm-router


def _flag(argv: list[str], name: str) -> list[str]:
    """Every value given after ``name``."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_the_router_has_every_engine_as_a_worker_on_loopback_ports() -> None:
    argv = router_argv(Path("/venv/bin/vllm-router"), 9000, 9001, ENGINES, "round_robin")
    assert argv[0] == "/venv/bin/vllm-router"
    assert _flag(argv, "--host") == ["127.0.0.1"] and _flag(argv, "--port") == ["9000"]
    # its Prometheus port is its own: the default (29000) would collide on a shared machine
    assert _flag(argv, "--prometheus-port") == ["9001"]
    assert _flag(argv, "--prometheus-host") == ["127.0.0.1"]
    assert _flag(argv, "--policy") == ["round_robin"]
    start = argv.index("--worker-urls") + 1
    assert argv[start : start + 2] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert "--kv-event-source" not in argv


def test_kv_aware_follows_each_engines_events_and_replay() -> None:
    kv = KvSources("sim-llama-8b", 128)
    argv = router_argv(Path("vllm-router"), 9000, 9001, ENGINES, "kv_aware", kv)
    assert _flag(argv, "--kv-event-source") == [
        "http://127.0.0.1:8001=tcp://127.0.0.1:5557",
        "http://127.0.0.1:8002=tcp://127.0.0.1:5559",
    ]
    # only the engine with a replay socket names one
    assert _flag(argv, "--kv-event-replay-source") == ["http://127.0.0.1:8001=tcp://127.0.0.1:5558"]
    assert _flag(argv, "--kv-event-block-size") == ["128"]
    assert _flag(argv, "--kv-event-model") == ["sim-llama-8b"]


def test_kv_aware_refuses_engines_without_events() -> None:
    silent = (BackendSpec("127.0.0.1", 8003),)
    with pytest.raises(ValueError, match="kv-events"):
        router_argv(Path("r"), 1, 2, silent, "kv_aware", KvSources("m", 16))


def test_the_block_size_is_the_engines_cache_config_label() -> None:
    metrics = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{_block_size_resolved="True",block_size="128",'
        'effective_attention_block_size="64",engine="0"} 1.0\n'
    )
    assert block_size_in(metrics) == 128
    assert block_size_in("vllm:num_requests_running 0\n") == DEFAULT_BLOCK_SIZE


# --------------------------------------------------------------------------- LiteLLM


def test_litellm_has_one_vllm_deployment_per_model_an_engine_serves() -> None:
    config = litellm_config(
        {"http://127.0.0.1:8001": ("model-a", "sql"), "http://127.0.0.1:8002": ("model-a",)},
        "sk-master",
    )
    assert config["general_settings"] == {"master_key": "sk-master"}
    deployments = [(d["model_name"], d["litellm_params"]) for d in config["model_list"]]

    def vllm(name: str, port: int) -> tuple[str, dict[str, str]]:
        base = f"http://127.0.0.1:{port}/v1"
        return name, {"model": f"hosted_vllm/{name}", "api_base": base, "api_key": "none"}

    assert deployments == [vllm("model-a", 8001), vllm("sql", 8001), vllm("model-a", 8002)]
    assert yaml.safe_load(yaml.safe_dump(config)) == config  # what the proxy reads


def test_litellm_runs_one_worker_on_loopback() -> None:
    argv = litellm_argv(Path("/venv/bin/litellm"), Path("/logs/litellm.yaml"), 9100)
    assert argv == [
        "/venv/bin/litellm",
        "--config",
        "/logs/litellm.yaml",
        "--host",
        "127.0.0.1",
        "--port",
        "9100",
        "--num_workers",
        "1",
    ]


def test_litellm_priorities_keep_the_order_in_its_range() -> None:
    assert [litellm_priority(p) for p in (-5, 0, 10, 20, 300)] == [0, 0, 10, 20, 255]


# --------------------------------------------------------------------------- clients


def test_what_each_arms_clients_send() -> None:
    # bench-x20: interactive 0, batch 20 (vLLM priorities, lower first)
    assert request_style("fifo", POLICY).extras("batch") == {}
    assert request_style("vllm-priority", POLICY).extras("batch") == {"priority": 20}
    assert request_style("vllm-router", POLICY).extras("batch") == {}
    assert request_style("vllm-router", POLICY).key("sk-own") == "sk-own"
    litellm = request_style("litellm", POLICY)
    assert (litellm.extras("interactive"), litellm.extras("batch")) == (
        {"priority": 0},
        {"priority": 20},
    )
    assert litellm.key("sk-own") == MASTER_KEY
    passed_on = request_style("litellm-priority", POLICY)
    assert passed_on.extras("batch") == {"extra_body": {"priority": 20}}
    assert passed_on.key("sk-own") == MASTER_KEY
    assert request_style(None, POLICY).extras("batch") == {}


# --------------------------------------------------------------------------- scenarios, report


def _scenario_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "peers",
        "duration_s": 10,
        "speedup": 10,
        "policy": str(POLICY),
        "groups": [
            {
                "name": "chat",
                "api_key": "sk-chat-demo",
                "tenant": "chat-app",
                "tier": "interactive",
                "rate": 1.0,
                "prompt_tokens": 32,
                "max_tokens": 4,
            }
        ],
        "arms": [{"name": "fifo", "kind": "fifo"}, {"name": "fairlane", "kind": "fairlane"}]
        + [{"name": kind, "kind": kind} for kind in PEER_KINDS],
    }
    data.update(changes)
    return data


def test_a_scenario_may_name_every_peer_kind_and_targets_relative_to_them() -> None:
    targets = [
        {
            "name": "throughput vs cache_aware",
            "metric": "throughput",
            "tier": "interactive",
            "arm": "fairlane",
            "baseline_arm": "vllm-router-cache",
            "min": 1.15,
        }
    ]
    scenario = parse_scenario(_scenario_data(targets=targets), Path("peers.yaml"))
    assert {a.kind for a in scenario.arms} >= set(PEER_KINDS)
    assert scenario.targets[0].baseline_arm == "vllm-router-cache"


@pytest.mark.parametrize(
    "name",
    [
        "flood-4seat",
        "flood-8seat",
        "flood-32seat",
        "flood-256seat",
        "flood-kv-bound",
        "flood-vllm-cpu",
        "power-user",
        "power-user-x5",
        "power-user-x5-varied",
        "shared-prefix",
        "prefix-kv-bound",
        "prefix-kv-bound-unseen",
        "prefix-vllm-cpu",
        "batch-flood",
        "multi-model",
        "lora-affinity",
    ],
)
def test_every_scheduling_and_routing_scenario_runs_a_peer_beside_fairlane(name: str) -> None:
    kinds = [a.kind for a in load_scenario(name).arms]
    peers = [k for k in kinds if k in PEER_KINDS]
    assert 1 <= len(peers) <= 2, (name, peers)  # the strongest applicable, bench time bounded


def test_the_report_names_the_peer_arms_that_ran() -> None:
    scenario = parse_scenario(_scenario_data(), Path("peers.yaml"))
    summary = arm_summary(scenario, [])

    def arm(kind: str) -> ArmResult:
        return ArmResult(kind, False, [], {}, False, 1.0, CpuUsage(wall_s=1.0), summary)

    arms = {"fifo": arm("fifo"), "cache": arm("vllm-router-cache"), "ll": arm("litellm")}
    (line,) = peer_lines(arms)
    assert "cache: vllm-router, cache_aware" in line and "vllm-router==0.1.17" in line
    assert "ll: LiteLLM proxy" in line and "vLLM priority" in line
    assert "fifo" not in line
    assert "vLLM" not in peer_lines({"cache": arm("vllm-router-cache")}, external=True)[0]
    assert peer_lines({"fifo": arm("fifo")}) == []


def test_kv_aware_on_engines_without_events_fails_the_arm_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RuntimeError is what the bench reports as a failed arm before it runs the next."""
    monkeypatch.setattr(start_module, "block_size", lambda url: 16)
    monkeypatch.setattr(router_module, "require", lambda peer: Path("vllm-router"))
    silent = (BackendSpec("127.0.0.1", 8003),)
    with ProcessGroup(tmp_path) as group, pytest.raises(RuntimeError, match="kv-events"):
        start_peer("vllm-router-kv", silent, group, "m")
    assert group.children == []
