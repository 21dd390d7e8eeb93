"""guidellm next to the bench's client: the command it runs, the prompts it sends (the
bench's own), how its figures are read and shown, and one run of the whole exchange with a
stand-in for guidellm (a script that times streamed requests through the arm as guidellm
does and writes its JSON), so the orchestration is checked without guidellm's venv."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from extproc.core.prompt import count_tokens, render_chat
from loadtests.bench.engine import Placement
from loadtests.bench.guidellm import (
    GuidellmInstall,
    Ttft,
    comparison_lines,
    default_group,
    guidellm_argv,
    guidellm_env,
    measurable,
    outside_ttft,
    read_ttft,
    settled_ttft,
    write_prompts,
)
from loadtests.bench.scenario import ScenarioError, load_scenario


def _options(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}


def test_guidellm_sends_the_group_at_its_rate_in_wall_seconds_with_its_key() -> None:
    scenario = load_scenario("flood-8seat")
    chat = scenario.group("chat")
    argv = guidellm_argv(
        Path("/g/guidellm"), "http://127.0.0.1:9", "sim-llama-8b", chat, 3.0, 20.0,
        Path("/d.jsonl"), Path("/tok"), Path("/o.json"),
    )  # fmt: skip
    assert argv[:2] == ["/g/guidellm", "run"]
    options = _options(argv)
    assert options["--profile"] == "kind=poisson,rate=3"  # 1 per simulated second at 3x
    backend = options["--backend"]
    assert "target=http://127.0.0.1:9" in backend and "api_key=sk-chat-demo" in backend
    assert "model=sim-llama-8b" in backend and "validate_backend=false" in backend
    assert options["--constraint"] == "kind=max_duration,seconds=20"
    assert options["--data"] == "kind=json_file,path=/d.jsonl"
    assert options["--output"] == "kind=json,path=/o.json"
    power = load_scenario("power-user").group("power-a")
    streams = guidellm_argv(
        Path("g"), "u", "m", power, 1.0, 5, Path("d"), Path("t"), Path("o")
    )  # fmt: skip
    assert _options(streams)["--profile"] == f"kind=concurrent,streams={power.concurrency}"
    assert guidellm_env()["GUIDELLM__MAX_WORKER_PROCESSES"] == "1"


def test_the_prompts_are_the_bench_clients_own(tmp_path: Path) -> None:
    scenario = load_scenario("flood-8seat")
    chat = scenario.group("chat")
    path = tmp_path / "prompts.jsonl"
    write_prompts(scenario, chat, path, 40)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 40
    for row in rows:
        assert 8 <= row["output_tokens_count"] <= 16  # the group's max_tokens
        tokens = count_tokens(render_chat([{"role": "user", "content": row["prompt"]}]))
        assert 32 <= tokens <= 1024  # the group's prompt_tokens, as the simulators count
    again = tmp_path / "again.jsonl"
    write_prompts(scenario, chat, again, 40)
    assert again.read_text() == path.read_text()  # seeded, as the bench's


def test_groups_guidellm_cannot_send_as_the_bench_does_are_refused() -> None:
    flood = load_scenario("flood-8seat")
    assert default_group(flood, flood.groups).name == "chat"
    assert measurable(flood.group("flood")) is not None  # not streamed
    shared = load_scenario("shared-prefix")
    assert any(measurable(g) for g in shared.groups)
    power = load_scenario("power-user-vllm-cpu")
    assert "pause" in (measurable(power.group("light-b")) or "")
    with pytest.raises(ScenarioError, match="no streamed open-loop group"):
        default_group(power, power.groups)


def test_guidellms_wall_milliseconds_are_read_as_simulated_seconds(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    ttft = {"count": 30, "median": 40.0, "percentiles": {"p90": 100.0, "p95": 150.0}}
    metrics = {"time_to_first_token_ms": {"successful": ttft}}
    path.write_text(json.dumps({"benchmarks": [{"metrics": metrics}]}))
    read = read_ttft(path, 3.0)
    assert (read.source, read.count) == ("guidellm 0.8.1", 30)
    assert (read.p50, read.p90, read.p95) == pytest.approx((0.12, 0.3, 0.45))
    lines = comparison_lines(
        load_scenario("flood-8seat"),
        "fairlane",
        load_scenario("flood-8seat").group("chat"),
        [Ttft("bench client", 25, 0.1, 0.3, None), read_ttft(path, 3.0)],
        0.42,
    )
    assert "guidellm 0.8.1 / bench" in lines[-2] and "1.20" in lines[-2] and "1.00" in lines[-2]
    assert lines[-1].endswith("0.42 of a core while it ran")
    path.write_text("{}")
    with pytest.raises(RuntimeError, match="no TTFT"):
        read_ttft(path, 1.0)


def test_guidellms_own_start_is_left_out_as_the_bench_leaves_out_its_warm_up(
    tmp_path: Path,
) -> None:
    """Its first connections and the requests it sends at once when it starts are its
    transient; the second row counts what follows, with the bench's percentiles."""
    starts = [100.0, 100.0, 101.0, 102.5, 103.0, 104.0, 105.0]
    ttfts = [600.0, 500.0, 300.0, 40.0, 50.0, 60.0, 70.0]
    requests = [
        {"request_start_time": t, "time_to_first_token_ms": ms}
        for t, ms in zip(starts, ttfts, strict=True)
    ]
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"benchmarks": [{"requests": {"successful": requests}}]}))
    settled = settled_ttft(path, 2.0, settle_s=2.0)
    assert settled.source == "guidellm after 2 s" and settled.count == 4
    assert settled.p50 == pytest.approx(0.11)  # (50 + 60) / 2 ms, x speedup 2
    assert settled.p95 == pytest.approx(0.137)  # 68.5 ms, interpolated as the bench does
    path.write_text("{}")
    with pytest.raises(RuntimeError, match="no requests"):
        settled_ttft(path, 1.0)


def test_an_install_that_is_missing_says_so(tmp_path: Path) -> None:
    assert "not installed" in (GuidellmInstall(tmp_path).problem() or "")
    (tmp_path / "guidellm-setup.error").write_text("scripts/setup-guidellm failed: pip")
    assert GuidellmInstall(tmp_path).problem() == "scripts/setup-guidellm failed: pip"


STAND_IN = r"""
import json, sys, time, urllib.request
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
backend = dict(kv.split("=", 1) for kv in args["--backend"].split(","))
rows = [json.loads(line) for line in open(args["--data"].split("path=", 1)[1])]
seconds = float(args["--constraint"].split("seconds=", 1)[1])
ttfts, timed, end = [], [], time.monotonic() + seconds
for row in rows:
    if time.monotonic() > end:
        break
    body = {"model": backend["model"], "stream": True, "ignore_eos": True,
            "max_completion_tokens": row["output_tokens_count"],
            "messages": [{"role": "user", "content": row["prompt"]}]}
    request = urllib.request.Request(
        backend["target"] + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"authorization": "Bearer " + backend["api_key"],
                 "content-type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        first = None
        for line in response:
            if first is None and b'"content"' in line:
                first = time.monotonic() - started
    ttfts.append(first * 1000)
    timed.append({"request_start_time": time.time() - first,
                  "time_to_first_token_ms": first * 1000})
ttfts.sort()
ttft = {"count": len(ttfts), "median": ttfts[len(ttfts) // 2],
        "percentiles": {"p90": ttfts[int(0.9 * len(ttfts))], "p95": ttfts[-1]}}
out = {"benchmarks": [{"metrics": {"time_to_first_token_ms": {"successful": ttft}},
                       "requests": {"successful": timed}}]}
open(args["--output"].split("path=", 1)[1], "w").write(json.dumps(out))
"""


@pytest.mark.integration
def test_guidellm_measures_the_group_while_the_bench_floods(tmp_path: Path) -> None:
    """The stand-in starts after the flood's warm-up, sends the chat group through the
    fairlane arm while the bench's client floods, and the flood stops when it is done."""
    cache = tmp_path / "cache"
    install = GuidellmInstall(cache)
    install.binary.parent.mkdir(parents=True)
    install.binary.write_text(f"#!{sys.executable}\n{STAND_IN}")
    install.binary.chmod(install.binary.stat().st_mode | stat.S_IXUSR)
    (cache / "guidellm-venv" / ".fairlane-guidellm-installed").write_text("stand-in")
    scenario = load_scenario("flood-8seat").with_overrides(duration_s=12.0, arms=["fairlane"])
    out = tmp_path / "out"
    out.mkdir()
    (summary, settled), cores = outside_ttft(
        scenario, "fairlane", scenario.group("chat"), out, Placement(()), tmp_path, install
    )
    assert summary.count >= 1 and summary.p50 is not None and summary.p50 > 0
    assert settled.count <= summary.count
    assert cores >= 0
    log = (out / "logs" / "fairlane-guidellm" / "guidellm.log").read_text()
    assert "Traceback" not in log
    assert os.path.exists(out / "prompts.jsonl")
