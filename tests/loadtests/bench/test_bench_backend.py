"""``fairlane bench SCENARIO --backend URL``: the arms target engines someone else started
(here two simulators the test starts itself, standing in for a real vLLM fleet), no simulator
is started by the harness, and the report says the engines' scheduling policy is theirs."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.fleet.backend import KVEventPorts
from extproc.ops.cli import main
from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready
from extproc.policy import load_policy
from loadtests.bench.scenario import SCENARIO_DIR

pytestmark = pytest.mark.integration


def _start_engines(group: ProcessGroup, speedup: str) -> list[str]:
    urls = []
    for i in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "extproc", "sim", "--port", str(port)]
        argv += ["--speedup", speedup, "--profile", "llama-8b-l4", "--max-num-seqs", "8"]
        child = group.start(f"engine-{i}", argv)
        urls.append(f"http://127.0.0.1:{port}")
        wait_http_ready(f"{urls[-1]}/health", child, timeout=30)
    return urls


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[str]]:
    """Two simulators on fcfs, at the smoke scenario's speedup, stopped after the test."""
    with ProcessGroup(tmp_path / "engines") as group:
        yield _start_engines(group, "20")


@pytest.fixture
def real_time_engines(tmp_path: Path) -> Iterator[list[str]]:
    """Two simulators on the wall clock (speedup 1), like real engines."""
    with ProcessGroup(tmp_path / "engines") as group:
        yield _start_engines(group, "1")


def test_bench_against_existing_backends(
    engines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["bench", "smoke", "--duration", "60", "--out", str(out)]
    for url in engines:
        args += ["--backend", url]
    assert main(args) == 0
    capsys.readouterr()
    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {}
    assert data["scenario"]["backends"]["external"] == engines
    for name, arm in data["arms"].items():
        assert not [p for p in arm["pids"] if p.startswith("sim")], name  # none started
        total = arm["summary"]["total"]
        assert total["ok"] > 0, f"{name}: no request succeeded: {total}\n{_log_tails(out, name)}"
    report = (out / "report.md").read_text()
    assert "their scheduling policy is their own" in report
    assert ", ".join(engines) in report
    # both engines got requests from both arms: the FIFO arm round-robins, the service picks
    for url in engines:
        metrics = _get(f"{url}/metrics")
        assert "vllm:request_success_total" in metrics


def test_default_policy_against_existing_backends(
    real_time_engines: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``policy: default`` with ``--backend`` and ``--speedup 1`` (real engines): the shipped
    policy at scale 1, written next to the report and read by the gateway."""
    scenario = yaml.safe_load((SCENARIO_DIR / "smoke.yaml").read_text())
    scenario.update(policy="default", speedup=20, duration_s=6, drain_s=10)
    path = tmp_path / "smoke-default.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "out"
    args = ["bench", str(path), "--speedup", "1", "--out", str(out)]
    for url in real_time_engines:
        args += ["--backend", url]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "divided by 1 (the run's speedup)" in err
    assert "warning: the policy" not in err
    data = json.loads((out / "results.json").read_text())
    assert data["failed_arms"] == {}
    assert data["scenario"]["policy_scale"] == 1
    written = Path(data["scenario"]["policy_file"])
    assert written == (out / "policy-default-x1.yaml").resolve()
    assert load_policy(written).tiers[0].queue_deadline_s == 10  # the default's, unscaled
    for name, arm in data["arms"].items():
        assert arm["summary"]["by_tier"]["interactive"]["ok"] > 0, name
    assert "durations divided by 1" in (out / "report.md").read_text()


@pytest.fixture
def engines_with_kv_events(tmp_path: Path) -> Iterator[list[str]]:
    """Two real-time simulators publishing vLLM's KV events (hashed with their builtin
    tokenizer), shaped as ``prefix-vllm-cpu``'s engines; ``--backend`` URLs with ports."""
    urls = []
    with ProcessGroup(tmp_path / "engines") as group:
        for i in range(2):
            port, events = free_port(), KVEventPorts(free_port(), free_port())
            argv = [sys.executable, "-m", "extproc", "sim", "--port", str(port)]
            argv += ["--model", "tiny", "--max-num-seqs", "4", "--num-gpu-blocks", "96"]
            argv += ["--block-size", "32", "--kv-events-config", events.engine_config()]
            child = group.start(f"engine-{i}", argv)
            wait_http_ready(f"http://127.0.0.1:{port}/health", child, timeout=30)
            urls.append(
                f"http://127.0.0.1:{port}#kv-events={events.port},kv-replay={events.replay_port}"
            )
        yield urls


def test_a_precise_arm_follows_existing_engines_events(
    engines_with_kv_events: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``prefix-vllm-cpu`` as against real engines: the precise arm follows the engines' own
    events with the tokenizer named (here the simulators'), every arm starts on emptied
    caches, and the report counts which index matched the grants."""
    out = tmp_path / "out"
    args = ["bench", "prefix-vllm-cpu", "--arms", "precise,approximate", "--duration", "12"]
    args += ["--tokenizer", "builtin", "--out", str(out)]
    for url in engines_with_kv_events:
        args += ["--backend", url]
    assert main(args) == 0, _log_tails(out, "precise")
    capsys.readouterr()
    data = json.loads((out / "results.json").read_text())
    assert data["scenario"]["backends"]["prefix_caches_kept"] == {}
    precise, approximate = data["arms"]["precise"], data["arms"]["approximate"]
    assert precise["prefix_matches"].get("precise", 0) > 0, precise["prefix_matches"]
    assert set(approximate["prefix_matches"]) == {"approximate"}
    report = (out / "report.md").read_text()
    assert "grants by prefix index" in report
    assert precise["prefix_predicted_tokens"].get("precise", 0) > 0  # it found prompts held
    assert "prefix caches were emptied before every arm" in report


def test_a_precise_arm_on_engines_without_events_is_refused(
    engines: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "prefix-vllm-cpu", "--tokenizer", "builtin"]
    for url in engines:
        args += ["--backend", url]
    assert main(args) == 1
    assert "follows the engines' KV events" in capsys.readouterr().err


def _log_tails(out: Path, arm: str) -> str:
    """The last lines of each log of one arm, so a failed arm says why."""
    tails = []
    for log in sorted((out / "logs" / arm).glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-15:]
        tails.append(f"--- {log.name}\n" + "\n".join(lines))
    return "\n".join(tails)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())
