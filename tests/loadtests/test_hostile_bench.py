"""``python -m loadtests.hostile --quick`` end to end, as a user runs it (about 15 s): a real
``fairlane serve`` attacked, a row per attack printed as it finishes and written to
``--out``, no attack broken, and every service stopped afterwards. A check that the benchmark
works, not a measurement: the figures are the full run's (``python -m loadtests.hostile``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pids import alive

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ATTACKS = "1,5,7"
ROWS = {"1", "1b", "5a", "5b", "7"}


def test_a_quick_run_prints_a_row_per_attack_and_stops_the_service(tmp_path: Path) -> None:
    out = tmp_path / "hostile.md"
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.hostile", "--quick", "--only", ATTACKS, "--out", out],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: a target missed
    table = out.read_text()
    rows = {
        line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")
    }
    assert rows.keys() >= ROWS, table
    for key in ROWS:
        row = rows[key]
        assert "broke" not in row and "NOT MEASURED" not in row, row
        assert row in done.stdout  # printed as it finished, the same as written
    verdicts = [rows[key].rstrip(" |").rsplit("|", 1)[1].strip() for key in ("1", "5a", "7")]
    assert set(verdicts) <= {"PASS", "FAIL"}, verdicts
    found = re.search(r"service pids ([\d, ]+), stopped", done.stdout)
    assert found is not None, done.stdout
    pids = [int(pid) for pid in found[1].split(",")]
    assert len(pids) == len(ROWS)  # a service of its own for each attack
    assert not any(map(alive, pids)), "a service was left running"
