"""``policy: default`` rescaling: every duration the gateway applies on its own (wall) clock is
divided by the speedup, nothing else changes, and the result is a policy the gateway accepts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.policy import DEFAULT_POLICY_PATH, Tier, load_policy, parse_policy
from loadtests.bench.policy_scale import (
    MIN_SCRAPE_INTERVAL_S,
    main,
    render_scaled_policy,
    rescale_policy,
    scaled_file_name,
    write_scaled_policy,
)

IDLE_DEFAULT_S = Tier("t", rank=0, priority=0, queue_limit=1, queue_deadline_s=1.0).reserved_idle_s
"""The model's ``reserved_idle_s`` when a file leaves it out (a duration, so rescaled)."""


def full_policy() -> dict[str, Any]:
    """A policy mapping that sets every time field (and a few others that must not move)."""
    return {
        "max_body_bytes": 1000,
        "max_in_flight_per_backend": 16,
        "fairness": {"flow": "tenant", "default_output_tokens": 256},
        "routing": {"queue_weight": 1, "sticky_margin": 0.25},
        "backpressure": {"scrape_interval_s": 0.2, "stale_after_s": 2.0},
        "tiers": [
            {
                "name": "interactive",
                "priority": 0,
                "queue_limit": 10,
                "queue_deadline_s": 10,
                "slo_ttft_ms": 500,
                "slo_latency_s": 5,
                "reserved_share": 0.25,
                "reserved_idle_s": 8,
                "hedge_after_ms": 1000,
                "gate": {"max_waiting": 3, "max_kv_cache_usage": 0.95, "max_itl_ms": 80},
                "early_shed_from": 0.9,
            },
            {
                "name": "batch",
                "priority": 20,
                "queue_limit": 100,
                "queue_deadline_s": 3600,
                "gate": {"max_waiting": 0, "max_itl_ms": 150},
                "aging": {"seconds_per_rank": 300, "max_ranks": 1},
            },
        ],
        "tenants": [{"name": "a", "api_keys": ["k"], "tiers": ["interactive", "batch"]}],
    }


def test_every_time_field_is_divided_and_nothing_else_changes() -> None:
    source = full_policy()
    scaled = rescale_policy(source, 10)
    chat, batch = scaled["tiers"]
    assert (chat["queue_deadline_s"], chat["slo_latency_s"], chat["reserved_idle_s"]) == (
        1,
        0.5,
        0.8,
    )
    assert (chat["slo_ttft_ms"], chat["hedge_after_ms"]) == (50, 100)
    assert batch["queue_deadline_s"] == 360
    assert batch["aging"] == {"seconds_per_rank": 30, "max_ranks": 1}
    assert scaled["backpressure"] == {"scrape_interval_s": 0.02, "stale_after_s": 0.2}
    # the engines' ITL is in simulated time already: the gate's bound is not scaled
    assert chat["gate"] == source["tiers"][0]["gate"]
    assert batch["gate"] == source["tiers"][1]["gate"]
    # everything else as it was
    untouched = copy.deepcopy(scaled)
    expected = copy.deepcopy(source)
    for data in (untouched, expected):
        data.pop("backpressure")
        for tier in data["tiers"]:
            for key in ("queue_deadline_s", "slo_latency_s", "reserved_idle_s", "slo_ttft_ms"):
                tier.pop(key, None)
            tier.pop("hedge_after_ms", None)
            tier.get("aging", {}).pop("seconds_per_rank", None)
    assert untouched == expected
    assert source == full_policy()  # the input is not changed


def test_rounding_and_minimums() -> None:
    source = full_policy()
    source["tiers"][0]["hedge_after_ms"] = 7
    scaled = rescale_policy(source, 3)
    chat = scaled["tiers"][0]
    assert chat["queue_deadline_s"] == 3.33333  # 6 significant digits
    assert chat["slo_ttft_ms"] == 167  # whole milliseconds, rounded
    assert chat["hedge_after_ms"] == 2
    assert rescale_policy(source, 1000)["tiers"][0]["hedge_after_ms"] == 1  # never 0 ms
    # the scrape interval stops at the floor; staleness keeps its ratio (10 scrapes) to it
    fast = rescale_policy(source, 100)["backpressure"]
    assert fast["scrape_interval_s"] == MIN_SCRAPE_INTERVAL_S == 0.005
    assert fast["stale_after_s"] == pytest.approx(0.05)
    assert fast["stale_after_s"] > fast["scrape_interval_s"]
    # at speedup 1 the numbers are the same
    assert rescale_policy(source, 1)["tiers"] == [
        {**t, "reserved_idle_s": t.get("reserved_idle_s", IDLE_DEFAULT_S)} for t in source["tiers"]
    ]


def test_defaults_that_are_durations_are_written_out_rescaled() -> None:
    source = full_policy()
    del source["backpressure"]
    del source["tiers"][0]["reserved_idle_s"]
    source["tiers"][1]["slo_ttft_ms"] = None  # null: no objective, stays null
    scaled = rescale_policy(source, 20)
    assert scaled["backpressure"] == {"scrape_interval_s": 0.005, "stale_after_s": 0.05}
    assert [t["reserved_idle_s"] for t in scaled["tiers"]] == [IDLE_DEFAULT_S / 20] * 2
    assert scaled["tiers"][1]["slo_ttft_ms"] is None
    assert "slo_ttft_ms" not in source["tiers"][0] or source["tiers"][0]["slo_ttft_ms"] == 500


def test_malformed_parts_are_left_for_validation() -> None:
    weird: dict[str, Any] = {"tiers": ["not a mapping", {"queue_deadline_s": "soon"}]}
    scaled = rescale_policy(weird, 5)
    assert scaled["tiers"][0] == "not a mapping"
    assert scaled["tiers"][1]["queue_deadline_s"] == "soon"
    with pytest.raises(ValueError, match="speedup must be"):
        rescale_policy(full_policy(), 0)


@pytest.mark.parametrize("speedup", [1, 1.5, 3, 20, 500])
def test_the_default_policy_rescaled_is_valid_and_means_the_same_simulated_times(
    speedup: float,
) -> None:
    shipped = load_policy(DEFAULT_POLICY_PATH)
    scaled = parse_policy(render_scaled_policy(DEFAULT_POLICY_PATH, speedup), "scaled")
    for before, after in zip(shipped.tiers, scaled.tiers, strict=True):
        assert after.queue_deadline_s * speedup == pytest.approx(before.queue_deadline_s, 1e-5)
        assert after.reserved_idle_s * speedup == pytest.approx(before.reserved_idle_s, 1e-5)
        assert after.aging_rate == pytest.approx(before.aging_rate * speedup, 1e-5)
        assert after.gate == before.gate
        if before.slo_ttft_ms is not None:
            assert after.slo_ttft_ms == max(1, round(before.slo_ttft_ms / speedup))
        assert (after.reserved_share, after.queue_limit) == (
            before.reserved_share,
            before.queue_limit,
        )
    interval = scaled.backpressure.scrape_interval_s
    assert interval == pytest.approx(max(shipped.backpressure.scrape_interval_s / speedup, 0.005))
    assert scaled.tenants == shipped.tenants
    assert scaled.rules == shipped.rules
    assert scaled.fairness == shipped.fairness and scaled.routing == shipped.routing


def test_written_copy_and_the_printing_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_scaled_policy(DEFAULT_POLICY_PATH, 20, tmp_path / "out")
    assert path.name == scaled_file_name(DEFAULT_POLICY_PATH, 20) == "policy-default-x20.yaml"
    text = path.read_text()
    assert text.startswith(f"# {DEFAULT_POLICY_PATH} rescaled for speedup 20")
    assert load_policy(path).tiers[0].queue_deadline_s == 0.5
    assert main(["20"]) == 0
    assert capsys.readouterr().out == text
    bad = tmp_path / "list.yaml"
    bad.write_text(yaml.safe_dump(["not", "a", "policy"]))
    assert main(["2", str(bad)]) == 1
    assert "a policy must be a mapping" in capsys.readouterr().err
