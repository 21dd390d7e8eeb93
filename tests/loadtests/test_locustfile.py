"""The locust load tests: the module's checks (in a process of their own) and one short
headless run against a real gateway stack (Envoy, the service, two fast simulators).

Nothing here imports locust: locust monkey-patches the importing process with gevent,
which would break the asyncio and grpc tests that share the pytest process.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.up import Stack, StackConfig
from tests.conftest import REPO

LOCUST = Path(sys.executable).with_name("locust")
TIERS = ("interactive", "api", "batch")


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's subprocess must see the defaults, whatever the developer exported."""
    for name in [name for name in os.environ if name.startswith("FAIRLANE_")]:
        monkeypatch.delenv(name)


def test_locust_module_checks_pass_in_their_own_process() -> None:
    checks = Path(__file__).with_name("locust_module_checks.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_importing_this_suite_did_not_patch_the_process_with_gevent() -> None:
    assert "gevent" not in sys.modules


def test_headless_run_reports_every_tier_and_ttft(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    try:
        config = StackConfig(
            port=free_port(), sim_args=("--speedup", "20", "--scheduling-policy", "priority")
        )
        stack = Stack(config, group).start()
        prefix = tmp_path / "run"
        done = subprocess.run(
            [
                str(LOCUST),
                "-f",
                str(REPO / "loadtests" / "locustfile.py"),
                "--headless",
                "-u",
                "6",
                "-r",
                "6",
                "-t",
                "6s",
                "--host",
                stack.url,
                "--csv",
                str(prefix),
                "--only-summary",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=40,
        )
    finally:
        group.stop()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    for tier in TIERS:
        row = rows.get(("POST", tier))
        assert row is not None and int(row["Request Count"]) > 0, (tier, sorted(rows), output)
    assert rows[("", "Aggregated")]["Failure Count"] == "0", output[-3000:]
    ttft = rows.get(("TTFT", "interactive"))
    assert ttft is not None, sorted(rows)
    assert int(ttft["Request Count"]) > 0
    assert 0 < float(ttft["Median Response Time"]) < 5000
    itl = rows.get(("ITL", "interactive"))
    assert itl is not None and 0 < float(itl["Median Response Time"]) < 1000, sorted(rows)
