"""Plots from hand-made records: every PNG is written, is a real PNG, and report.md links it
under the right section."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from loadtests.bench import cpu, plots, stats
from loadtests.bench.client import RequestRecord
from loadtests.bench.results import ArmResult, ArmSummary, BenchResults

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(
    arm: str,
    tier: str,
    tenant: str,
    start: float,
    ttft: float,
    e2e: float,
    queue_ms: float | None = None,
    ok: bool = True,
) -> RequestRecord:
    return RequestRecord(
        arm=arm,
        group=tier,
        tenant=tenant,
        tier=tier,
        index=0,
        client=0,
        start_s=start,
        prompt_tokens_sent=100,
        max_tokens=50,
        stream=True,
        ttft_s=ttft if ok else None,
        e2e_s=e2e,
        end_s=start + e2e,
        status=200 if ok else 429,
        ok=ok,
        prompt_tokens=100 if ok else 0,
        completion_tokens=50 if ok else 0,
        queue_ms=queue_ms,
    )


def records() -> dict[str, list[RequestRecord]]:
    fifo = [rec("fifo", "interactive", "chat", t, 0.1 + t / 100, 1 + t / 50) for t in range(60)]
    fifo += [rec("fifo", "batch", "nightly", t, 5.0, 8.0) for t in range(0, 60, 3)]
    fairlane = [
        rec("fairlane", "interactive", "chat", t, 0.1, 1.0, queue_ms=10.0) for t in range(60)
    ]
    fairlane += [
        rec("fairlane", "batch", "nightly", t, 9.0, 12.0, queue_ms=200.0) for t in range(0, 60, 3)
    ]
    fairlane.append(rec("fairlane", "batch", "nightly", 30, 0, 0.5, queue_ms=500.0, ok=False))
    return {"fifo": fifo, "fairlane": fairlane}


def arm_result(kind: str, summary: ArmSummary) -> ArmResult:
    return ArmResult(kind, False, [], {}, False, 1.0, cpu.CpuUsage(1.0), summary)


def results(recs: dict[str, list[RequestRecord]]) -> BenchResults:
    scenario = {"name": "hand-made", "warmup_s": 5.0, "duration_s": 60.0, "speedup": 20.0}
    window = stats.Window(5.0, 60.0)
    arms: dict[str, ArmResult] = {}
    for arm, rs in recs.items():
        tiers = {
            t: stats.selection_stats([r for r in rs if r.tier == t], window, 20.0)
            for t in ("interactive", "batch")
        }
        tenants = {
            t: stats.selection_stats([r for r in rs if r.tenant == t], window, 20.0)
            for t in ("chat", "nightly")
        }
        total = sum(s.service_tokens for s in tenants.values())
        tenants = {
            t: dataclasses.replace(s, share=s.service_tokens / total) for t, s in tenants.items()
        }
        arms[arm] = arm_result(arm, ArmSummary(by_tier=tiers, by_tenant=tenants))
    return BenchResults(scenario, arms)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, (path, len(data))  # drawn, not an empty canvas


def test_write_plots_writes_valid_pngs(tmp_path: Path) -> None:
    recs = records()
    sections = plots.write_plots(tmp_path, results(recs), recs)
    names = {p.name for paths in sections.values() for p in paths}
    assert names == {
        "ttft_cdf_interactive.png",
        "e2e_cdf_interactive.png",
        "ttft_cdf_batch.png",
        "e2e_cdf_batch.png",
        "queue_depth.png",
        "throughput.png",
        "service_share.png",
    }
    assert list(sections) == [
        "## Tier `interactive`",
        "## Tier `batch`",
        "## Total (the whole fleet)",
        "## Tenants",
    ]
    for name in names:
        assert_png(tmp_path / name)


def test_tier_names_are_made_safe_for_file_names(tmp_path: Path) -> None:
    recs = {"fifo": [rec("fifo", "a b/c", "t", 1.0, 0.5, 1.0)]}
    res = BenchResults(
        {"name": "x", "warmup_s": 0.0, "duration_s": 10.0, "speedup": 1.0},
        {"fifo": arm_result("fifo", ArmSummary())},
    )
    plots.write_plots(tmp_path, res, recs)
    assert_png(tmp_path / "ttft_cdf_a_b_c.png")


def test_embed_puts_images_at_the_end_of_their_sections() -> None:
    md = "# r\n\n## Tier `a`\n\n| x |\n\n## Total (the whole fleet)\n\n| y |\n\n## CPU\n\nz\n"
    out = plots.embed(
        md,
        {
            "## Tier `a`": [Path("/o/ttft_cdf_a.png")],
            "## Total (the whole fleet)": [Path("/o/throughput.png")],
            "## Tenants": [Path("/o/service_share.png")],  # no such section: goes last
        },
    )
    lines = out.splitlines()
    assert lines.index("![ttft cdf a](ttft_cdf_a.png)") < lines.index("## Total (the whole fleet)")
    assert (
        lines.index("| y |") < lines.index("![throughput](throughput.png)") < lines.index("## CPU")
    )
    assert lines[-3:] == ["## Plots", "", "![service share](service_share.png)"]


def test_a_plotting_failure_keeps_the_report(tmp_path: Path) -> None:
    broken = BenchResults({"name": "x"})  # no times: KeyError
    recs = {"fifo": [rec("fifo", "a", "t", 1.0, 0.5, 1.0)]}
    out = plots.add_plots("# report\n", tmp_path, broken, recs)
    assert out.startswith("# report\n") and "plots not drawn: KeyError" in out


def test_importing_report_does_not_load_matplotlib() -> None:
    code = (
        "import sys, loadtests.bench.report, loadtests.bench.plots; "
        "print('matplotlib' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
