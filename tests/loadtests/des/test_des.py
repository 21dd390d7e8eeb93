"""The discrete-event simulation: fairlane's real core and the per-step engines on one
virtual clock (``loadtests.des``), on a fleet small enough to run in seconds."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc.fleet.vllm_metrics import EngineMetrics
from loadtests.bench.scenario import ScenarioError, read_document
from loadtests.des import report
from loadtests.des import run as run_module
from loadtests.des.clock import EventLoop
from loadtests.des.engines import EngineNode
from loadtests.des.model import DesScenario, parse_des
from loadtests.des.run import Simulation, bench, simulate
from loadtests.sim.engine import EngineConfig, EngineRequest
from loadtests.sim.profiles import get_profile

SMALL = """\
kind: des
name: small
seed: 3
duration_s: 600
warmup_s: 20
max_requests: 1500
fleet: {engines: 6, regions: 2, max_num_seqs: 8}
open_loop:
  tenants: 300
  rate_per_s: 3
  chat: {prompt_tokens: [64, 256], output_tokens: [8, 32]}
  api: {prompt_tokens: [128, 512], output_tokens: [16, 64]}
closed_loops:
  - {name: batch, tier: batch, count: 3, concurrency: 20,
     prompt_tokens: [128, 512], output_tokens: [16, 64]}
sweep: [[3, 100], [6, 300]]
sweep_requests: 300
"""


def scenario(tmp_path: Path, text: str = SMALL) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(text)
    return path


def test_the_event_loop_runs_in_time_order_and_same_time_events_in_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for when, name in ((2.0, "c"), (1.0, "a"), (1.0, "b")):
        loop.at(when, lambda n: seen.append((loop.now, n)), name)
    loop.run_until(1.5)
    assert seen == [(1.0, "a"), (1.0, "b")] and loop.now == 1.5
    loop.run_until(5.0)
    assert seen[-1] == (2.0, "c")


def test_every_request_is_answered_and_the_backlogged_batch_jobs_share_evenly(
    tmp_path: Path,
) -> None:
    sim, measured = simulate(parse_des(read_document(scenario(tmp_path))), tmp_path / "work")
    stats = measured.stats
    assert stats.sent == 1500 and sim.in_progress == 0  # the run ended when all were answered
    assert sum(stats.statuses.values()) == stats.measured
    # Only batch fails: admission cancels running batch requests to seat chat (503, as
    # extproc.transport.held answers them), and their clients send them again.
    assert {key for key in stats.statuses if key[1] != 200} <= {("batch", 503)}
    assert 0 < stats.statuses[("batch", 503)] <= stats.preempted
    assert {"interactive", "api", "batch"} <= set(stats.ttft)
    # Chat is served ahead of the batch flood: its median first token beats batch's.
    chat, batch = sorted(stats.ttft["interactive"]), sorted(stats.ttft["batch"])
    assert chat[len(chat) // 2] < batch[len(batch) // 2]
    served = [stats.served[f"batch{i}"] for i in range(3)]
    assert min(served) > 0.8 * max(served), served
    assert measured.decision_us > 0 and measured.calls["handle"] == 1500


def test_bench_writes_the_contracted_results(tmp_path: Path) -> None:
    results = bench(parse_des(read_document(scenario(tmp_path))), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written == json.loads(json.dumps(results))
    assert set(written["decision_us_per_request"]) == {"3x100", "6x300"}
    assert all(us > 0 for us in written["decision_us_per_request"].values())
    assert 0.9 <= written["jain_backlogged"] <= 1.0
    assert written["max_batch_wait_s"] >= 0
    assert written["run"]["aging_bound_s"] == 300  # the default policy's batch aging
    assert written["memory_bytes"]["per_tenant"] > 0
    assert (tmp_path / "out" / "report.md").read_text().startswith("# `small`")
    assert (tmp_path / "out" / "decision-cost.png").stat().st_size > 0


def test_a_sweep_point_of_the_scenarios_own_size_is_its_run_not_a_second_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # scale-day's sweep holds its own 1,000 x 100k: under --duration the run is that point,
    # and simulating it again would double the bench's longest part.
    text = SMALL.replace("duration_s: 600", "duration_s: 40")
    text = text.replace("max_requests: 1500", "max_requests: 100000")
    text = text.replace("sweep_requests: 300", "sweep_requests: 100000")
    runs: list[str] = []
    real = run_module.simulate

    def counted(sized: DesScenario, workdir: Path, fast_forward: bool = True) -> Any:
        runs.append(sized.name)
        return real(sized, workdir, fast_forward)

    monkeypatch.setattr(run_module, "simulate", counted)
    results = bench(parse_des(read_document(scenario(tmp_path, text))), tmp_path / "out")
    assert runs == ["small", "small-3x100"]
    assert results["sweep"]["6x300"] == results["run"]
    assert results["decision_us_per_request"]["6x300"] == results["run"]["decision_us"]


def test_a_bad_scenario_names_its_lines(tmp_path: Path) -> None:
    bad = SMALL.replace("engines: 6", "engines: 0").replace("rate_per_s: 3", "rate_per_s: fast")
    with pytest.raises(ScenarioError) as error:
        parse_des(read_document(scenario(tmp_path, bad)))
    message = str(error.value)
    assert "small.yaml:7: fleet.engines: must be an integer >= 1, got 0" in message
    assert "small.yaml:10: open_loop.rate_per_s:" in message


@pytest.mark.parametrize("outage", ["", "outage: {region: r1, at_s: 40, for_s: 20}\n"])
def test_the_decode_fast_forward_changes_no_request_and_no_scrape(
    tmp_path: Path, outage: str
) -> None:
    """The same run stepped one event per engine step and fast-forwarded over decode
    stretches: every request ends at the same time with the same status, and every scrape
    reads the same numbers (float rounding aside: the fast-forward sums a series in closed
    form). With an outage, engines die in the middle of stretches too."""
    path = scenario(tmp_path, SMALL + outage)
    runs: dict[bool, tuple[Simulation, list[tuple[str, float, EngineMetrics]]]] = {}
    for fast_forward in (False, True):
        sim = Simulation(
            parse_des(read_document(path)), tmp_path / f"w{fast_forward}", fast_forward, True
        )
        scraped: list[tuple[str, float, EngineMetrics]] = []
        for node in sim.nodes.values():
            node.metrics = _recording(node, scraped)  # type: ignore[method-assign,assignment]
        sim.run()
        runs[fast_forward] = (sim, scraped)
    (plain, plain_scrapes), (fast, fast_scrapes) = runs[False], runs[True]
    assert sum(n.skipped for n in plain.nodes.values()) == 0
    skipped = sum(n.skipped for n in fast.nodes.values())
    assert skipped > 0.4 * sum(n.steps for n in fast.nodes.values())
    assert plain.flights.keys() == fast.flights.keys() and len(plain.flights) == 1500
    for request_id, p in plain.flights.items():
        f = fast.flights[request_id]
        assert (p.status, p.tried, p.node and p.node.address) == (
            f.status,
            f.tried,
            f.node and f.node.address,
        ), request_id
        for a, b in ((p.forwarded_at, f.forwarded_at), (p.first_at, f.first_at)):
            assert a is b is None or (a is not None and b is not None and close(a, b))
        assert p.ended_at is not None and f.ended_at is not None
        assert close(p.ended_at, f.ended_at), (request_id, p.ended_at, f.ended_at)
    assert len(plain_scrapes) == len(fast_scrapes) > 1000
    for (pa, pt, pm), (fa, ft, fm) in zip(plain_scrapes, fast_scrapes, strict=True):
        assert (pa, pm.waiting, pm.running, pm.itl_count) == (
            fa,
            fm.waiting,
            fm.running,
            fm.itl_count,
        )
        assert close(pt, ft) and close(pm.kv_cache_usage, fm.kv_cache_usage)
        assert pm.itl_sum_s is not None and fm.itl_sum_s is not None  # the sim exports ITL
        assert close(pm.itl_sum_s, fm.itl_sum_s)
    if outage:
        assert any(f.tried > 1 for f in fast.flights.values())  # retried after the loss


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def _recording(
    node: EngineNode, seen: list[tuple[str, float, EngineMetrics]]
) -> Callable[[float], EngineMetrics]:
    """``node.metrics``, each reading also appended to ``seen``."""
    read = node.metrics

    def metrics(now: float) -> EngineMetrics:
        result = read(now)
        seen.append((node.address, now, result))
        return result

    return metrics


def test_a_closed_loop_sends_only_in_its_window_and_the_scale_scenarios_parse(
    tmp_path: Path,
) -> None:
    """``start_s``/``stop_s`` make a nightly batch job; ``scale-day`` uses them. The shipped
    ``scale-*.yaml`` files all parse (running them is ``fairlane bench``'s job)."""
    batch_sizes = "     prompt_tokens: [128, 512], output_tokens: [16, 64]}"  # the batch loop's
    text = SMALL.replace(batch_sizes, batch_sizes[:-1] + ", start_s: 30, stop_s: 90}")
    sim = Simulation(parse_des(read_document(scenario(tmp_path, text))), tmp_path / "w", True, True)
    sim.run()
    batch = [f for f in sim.flights.values() if f.ask.tier == "batch"]
    assert batch and all(30 <= f.arrival < 90 for f in batch)
    # A slice of the day from t = 60: nothing arrives before, the batch job joins at once.
    later = Simulation(
        parse_des(read_document(scenario(tmp_path, text + "start_s: 60\n"))),
        tmp_path / "w2",
        True,
        True,
    )
    later.run()
    assert later.flights and min(f.arrival for f in later.flights.values()) >= 60
    assert {f.ask.tier for f in later.flights.values() if f.arrival < 61} >= {"batch"}
    bad = SMALL.replace(batch_sizes, batch_sizes[:-1] + ", start_s: 9, stop_s: 5}")
    with pytest.raises(ScenarioError, match=r"closed_loops\[0\]\.stop_s: must be after start_s"):
        parse_des(read_document(scenario(tmp_path, bad)))
    shipped = sorted(Path(__file__).parents[3].glob("loadtests/scenarios/scale-*.yaml"))
    assert {p.stem for p in shipped} >= {"scale-smoke", "scale-day"}
    for path in shipped:
        parse_des(read_document(path))


def test_a_region_outage_is_reported_before_during_and_after(tmp_path: Path) -> None:
    """Region r1 (3 of 6 engines) dies at 40 s for 20 s: requests on it are retried or cut,
    and the summary splits TTFT and statuses by the phase a request arrived in."""
    text = SMALL + "outage: {region: r1, at_s: 40, for_s: 20}\n"
    parsed = parse_des(read_document(scenario(tmp_path, text)))
    _, measured = simulate(parsed, tmp_path / "w")
    summary = report.run_summary(parsed, measured, None)
    outage = summary["outage"]
    assert (outage["region"], outage["from_s"], outage["to_s"]) == ("r1", 40, 60)
    assert outage["lost_in_flight"] > 0
    phases = outage["phases"]
    assert set(phases) == {"before", "during", "after"}
    for figures in phases.values():
        assert figures["ttft_s"]["batch"]["n"] > 0
    counted = sum(n for f in phases.values() for t in f["statuses"].values() for n in t.values())
    assert counted == measured.stats.measured
    assert "## Region r1 down from 40 s to 60 s" in report.markdown(
        {"scenario": "small", "run": summary, "sweep": {}, "memory_bytes": {}}
    )


def test_an_engine_dying_in_a_step_loses_the_requests_that_step_finished() -> None:
    """``Engine.step`` finishes a request when the step begins (its blocks are freed) but
    its last token leaves at the step's end: an engine killed in between must hand it to
    Envoy with the rest, or its client waits forever."""
    loop = EventLoop()
    config = EngineConfig(get_profile("llama-8b-l4"), max_num_seqs=4)
    node = EngineNode(loop, "10.0.0.1:8000", "r0", config)
    req = EngineRequest("one", prompt_len=40, block_hashes=[], max_tokens=1, output_len=1)
    node.submit(req)  # the prefill step that also produces its only token starts now
    assert req.finish_reason == "length" and not node.engine.has_work
    assert node.kill() == [req]
    loop.run_until(10.0)  # the dead step's end is ignored


def test_a_fleet_of_several_models_sends_each_request_to_its_models_engines(
    tmp_path: Path,
) -> None:
    text = SMALL.replace("max_num_seqs: 8}", "max_num_seqs: 8, models: 3}")
    text = text.replace("max_requests: 1500", "max_requests: 600")
    sim, measured = simulate(parse_des(read_document(scenario(tmp_path, text))), tmp_path / "w")
    assert measured.stats.sent == 600 and sim.in_progress == 0
    assert {key for key in measured.stats.statuses if key[1] != 200} <= {("batch", 503)}
    pool = sim.core.pool
    served = {b.address: b.models.bases for b in pool.backends if b.models is not None}
    assert sorted(map(sorted, set(served.values()))) == [["model-0"], ["model-1"], ["model-2"]]
    # every grant's band names the pool of the engine it went to
    assert set(sim.core.admission.scheduler.depths()) >= {"batch@model-0", "batch@model-2"}


def test_the_model_sweep_reports_each_point_against_one_pool(tmp_path: Path) -> None:
    text = SMALL.replace("sweep: [[3, 100], [6, 300]]", "model_sweep: [[1, 3], [3, 6]]")
    results = bench(parse_des(read_document(scenario(tmp_path, text))), tmp_path / "out")
    assert set(results["model_sweep"]) == {"1x3", "3x6"}
    assert set(results["model_sweep_ratio"]) == {"3x6"}
    assert results["model_sweep_ratio"]["3x6"] > 0
    assert "| 3x6 |" in (tmp_path / "out" / "report.md").read_text()
