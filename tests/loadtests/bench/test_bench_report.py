"""Report statistics on hand-made records: percentiles, Jain, shares, goodput, waits, targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench import client, cpu, report, stats, targets
from loadtests.bench.client import RequestRecord
from loadtests.bench.results import ArmResult, ArmSummary, BenchResults
from loadtests.bench.scenario import Target, load_scenario
from loadtests.bench.stats import Window, jain_index, percentile, selection_stats


def rec(
    tier: str = "interactive",
    tenant: str = "chat-app",
    group: str = "chat",
    start: float = 10.0,
    ttft: float | None = 1.0,
    e2e: float | None = 2.0,
    prompt: int = 100,
    completion: int = 50,
    ok: bool = True,
    status: int = 200,
    unfinished: bool = False,
    queue_ms: float | None = None,
) -> RequestRecord:
    return RequestRecord(
        arm="a",
        group=group,
        tenant=tenant,
        tier=tier,
        index=0,
        client=0,
        start_s=start,
        prompt_tokens_sent=prompt,
        max_tokens=completion,
        stream=True,
        ttft_s=ttft,
        e2e_s=e2e,
        end_s=None if e2e is None else start + e2e,
        status=status,
        ok=ok,
        unfinished=unfinished,
        prompt_tokens=prompt if ok else 0,
        completion_tokens=completion if ok else 0,
        queue_ms=queue_ms,
    )


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 0) == 1.0
    assert percentile(values, 95) == pytest.approx(8.8)  # numpy.percentile(values, 95)
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0


def test_jain_index() -> None:
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([50, 10]) == pytest.approx(3600 / (2 * 2600))
    assert jain_index([0, 0]) == 1.0
    assert jain_index([]) is None


def test_selection_stats_window_goodput_waits_and_counts() -> None:
    records = [
        rec(start=1, ttft=9.0, e2e=9.5),  # started in the warm-up: no latency percentiles
        rec(start=20, ttft=1.0, e2e=3.0, completion=60),
        rec(start=30, ttft=2.0, e2e=4.0, completion=40, queue_ms=100),
        rec(start=95, ttft=1.0, e2e=10.0, completion=1000),  # ends after the window: no goodput
        rec(start=40, ttft=None, e2e=3.0, ok=False, status=503),  # shed after 3 s
        rec(start=50, ttft=None, e2e=45.0, ok=False, status=0, unfinished=True),
    ]
    figures = selection_stats(records, Window(10, 100), speedup=20)
    assert figures.sent == 6 and figures.ok == 4
    assert figures.errors == {"503": 1}
    assert figures.unfinished == 1
    assert figures.measured == 3
    assert figures.ttft_p50 == 1.0
    assert figures.e2e_p99 == pytest.approx(percentile([3.0, 4.0, 10.0], 99))
    # finished inside [10, 100]: the 2nd and 3rd (the 1st ended at 10.5, also inside)
    assert figures.goodput == pytest.approx((50 + 60 + 40) / 90)
    assert figures.service_tokens == 3 * 100 + 2 * (50 + 60 + 40)
    assert figures.plain_tokens == 3 * 100 + 50 + 60 + 40
    # the unfinished request waited 45 s without a token: it is the maximum wait
    assert figures.wait_max == 45.0
    assert figures.queue_wait_max == pytest.approx(0.1 * 20)  # wall ms x speedup
    # the window is 90 simulated s = 4.5 wall s at speedup 20: tokens per wall minute
    assert figures.tokens_per_wall_min == pytest.approx((3 * 100 + 50 + 60 + 40) / (4.5 / 60))
    assert figures.error_share == pytest.approx(1 / 6)
    assert figures.rate_limited == 0 and figures.rate_limit_headers_ok is None


def test_rate_limited_answers_and_their_headers_are_counted() -> None:
    good = {
        "retry-after": "7",
        "x-ratelimit-limit-tokens": "20000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "58s",
    }
    assert client.rate_limit_headers_ok(good)
    both = {**good, "x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "0"}
    assert client.rate_limit_headers_ok({**both, "x-ratelimit-reset-requests": "1m0s"})
    assert not client.rate_limit_headers_ok(both)  # half of the requests headers
    assert not client.rate_limit_headers_ok({**good, "retry-after": "0.5"})
    assert not client.rate_limit_headers_ok({**good, "x-ratelimit-reset-tokens": "soon"})
    assert not client.rate_limit_headers_ok({k: v for k, v in good.items() if k != "retry-after"})
    limited = [rec(start=20, ok=False, status=429) for _ in range(4)]
    for i, record in enumerate(limited):
        record.rate_limited, record.rate_limit_headers = True, i > 0
    figures = selection_stats([*limited, rec(start=20)], Window(10, 100), speedup=20)
    assert figures.rate_limited == 4 and figures.rate_limit_headers_ok == 0.75
    assert figures.error_share == 0.8


def test_arm_summary_shares_and_targets() -> None:
    scenario = load_scenario("power-user")
    records = [
        rec(tier="api", tenant="power-a", group="power-a", start=50, completion=100),
        rec(tier="api", tenant="power-a", group="power-a", start=60, completion=100),
        rec(tier="api", tenant="power-a", group="power-a", start=70, completion=100),
        rec(tier="api", tenant="tenant-d", group="heavy-d", start=50, completion=100),
        rec(tier="api", tenant="tenant-b", group="light-b", start=50, e2e=3.0),
    ]
    summary = stats.arm_summary(scenario, records)
    tenants = summary.by_tenant
    service = {t: s.service_tokens for t, s in tenants.items()}
    assert service["power-a"] == 3 * 300 and service["tenant-d"] == 300
    assert tenants["power-a"].share == pytest.approx(900 / (900 + 300 + 200))
    assert sum(s.share or 0.0 for s in tenants.values()) == pytest.approx(1.0)
    assert "tenant-c" not in tenants

    unloaded = stats.arm_summary(
        scenario, [rec(tier="api", tenant="tenant-b", group="light-b", start=50, e2e=2.0)]
    )
    results = {
        r.target.name: r
        for r in targets.evaluate(
            scenario.targets, {"fairlane": summary, "fairlane-unloaded": unloaded}
        )
    }
    b = results["tenant-b p95 latency <= 1.5x unloaded"]
    assert b.measured == pytest.approx(1.5) and b.passed is True
    c = results["tenant-c p95 latency <= 1.5x unloaded"]
    assert c.passed is None and c.note == "no data"
    jain = results["backlogged equal-weight tenants share evenly (Jain)"]
    assert jain.measured == pytest.approx(jain_index([900, 300]))
    assert jain.passed is False
    # weights divide the service: power-a with weight 3 is exactly even with tenant-d
    weighted = targets.evaluate(
        [t for t in scenario.targets if t.metric == "jain"],
        {"fairlane": summary},
        weights={"power-a": 3.0},
    )
    assert weighted[0].measured == pytest.approx(1.0) and weighted[0].passed is True
    assert "FAIL" in jain.line() and "0.8" in jain.line()


def test_target_against_a_missing_arm_is_not_applicable() -> None:
    target = Target(
        name="x",
        metric="goodput",
        arm="fairlane",
        bound=0.9,
        op="min",
        tier="batch",
        baseline_arm="fifo",
    )
    (result,) = targets.evaluate([target], {"fairlane": ArmSummary(by_tier={})})
    assert result.passed is None and "fifo" in result.note


def test_cpu_warnings() -> None:
    busy = cpu.CpuUsage(wall_s=10, cores={cpu.LOADGEN: 0.8}, machine_cores=1.9, machine_capacity=2)
    found = cpu.warnings(busy)
    assert len(found) == 2 and all(w.startswith("WARNING") for w in found)
    calm = cpu.CpuUsage(wall_s=10, cores={cpu.LOADGEN: 0.2}, machine_cores=0.8, machine_capacity=2)
    assert cpu.warnings(calm) == []
    # a 200 ms stall at speedup 20 is 4 simulated seconds: flagged; at speedup 1 it is not
    stalled = cpu.CpuUsage(wall_s=10, loop_lag_max_s=0.2, speedup=20, machine_capacity=2)
    (warning,) = cpu.warnings(stalled)
    assert "stalled for up to 200 ms wall (4.0 s simulated" in warning
    assert cpu.warnings(cpu.CpuUsage(wall_s=10, loop_lag_max_s=0.2, speedup=1)) == []
    import os

    assert cpu.process_cpu_seconds(os.getpid()) is not None
    assert cpu.process_cpu_seconds(2**22 + 12345) is None


def test_markdown_and_json(tmp_path: Path) -> None:
    scenario = load_scenario("smoke")
    records = {"fifo": [rec()], "fairlane": [rec(queue_ms=20.0)]}
    usage = cpu.CpuUsage(3.0, {"envoy": 0.1, cpu.LOADGEN: 0.9}, 1.0, 2)
    usage.warnings = cpu.warnings(usage)
    arms = {
        name: ArmResult(
            kind=name,
            balanced=False,
            groups=["chat"],
            pids={},
            capped=name == "fifo",
            wall_s=3.0,
            cpu=usage,
            summary=stats.arm_summary(scenario, recs),
            replica_flows={"r1": {"chat": 1}, "r2": {}} if name == "fairlane" else {},
        )
        for name, recs in records.items()
    }
    verdicts = targets.evaluate(scenario.targets, {n: a.summary for n, a in arms.items()})
    results = BenchResults(
        scenario={
            "name": "smoke",
            "description": "d",
            "duration_s": 50,
            "speedup": 20,
            "warmup_s": 0,
            "seed": 7,
            "max_requests": 500,
            "policy": "p.yaml",
            "backends": {"count": 1, "profile": "x", "flags": []},
        },
        arms=arms,
        failed_arms={"other": "NotReady: sim died"},
        targets=verdicts,
    )
    md, js = report.write(tmp_path, results, records)
    text = md.read_text()
    assert "| fifo | fairlane |" in text
    assert "simulated seconds" in text
    assert "WARNING: the load generator" in text
    assert "request cap (500) was hit" in text
    assert "NotReady: sim died" in text
    assert "PASS" in text or "FAIL" in text
    data = json.loads(js.read_text())
    assert data["records"]["fairlane"][0]["queue_ms"] == 20.0
    assert set(data["arms"]) == {"fifo", "fairlane"}
    assert "- fairlane: r1: chat 1; r2: nothing" in text
    assert "- fifo:" not in text.split("## Flows by replica")[1]
    assert ArmResult.from_json(data["arms"]["fairlane"]).replica_flows == {
        "r1": {"chat": 1},
        "r2": {},
    }
