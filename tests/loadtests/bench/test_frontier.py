"""The frontier tool's policies: the shipped default with one lever moved (no processes)."""

from __future__ import annotations

from pathlib import Path

from extproc.policy import load_policy
from loadtests.bench.frontier import policy_with_ceiling


def test_each_point_is_the_default_policy_with_one_lever_moved(tmp_path: Path) -> None:
    shipped = load_policy(policy_with_ceiling(0.25, 1, tmp_path))
    assert shipped.tier("interactive").reserved_share == 0.25
    assert shipped.tier("batch").preemptible
    assert shipped.tier("batch").gate.max_in_flight is None
    moved = load_policy(policy_with_ceiling(0.5, 2, tmp_path, preemptible=False, batch_cap=64))
    assert moved.tier("interactive").reserved_share == 0.5
    assert not moved.tier("batch").preemptible
    assert moved.tier("batch").gate.max_in_flight == 64
    assert moved.backpressure.scrape_interval_s == shipped.backpressure.scrape_interval_s / 2
