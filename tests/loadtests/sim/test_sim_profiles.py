"""Step-time models: every profile prices prefill, batch size and context."""

from __future__ import annotations

import pytest

from loadtests.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_step_time_grows_with_each_term(name: str) -> None:
    p = get_profile(name)
    base = p.step_seconds(0, 1, 100)
    assert p.step_seconds(0, 64, 100) > base  # batch size
    assert p.step_seconds(0, 1, 100_000) > base  # context
    assert p.step_seconds(2048, 1, 100) > p.step_seconds(512, 1, 100) > base  # prefill
    assert p.source and p.num_gpu_blocks > 0


def test_default_is_an_8b_model_on_one_h100_with_plausible_decode_latency() -> None:
    p = get_profile(DEFAULT_PROFILE)
    assert DEFAULT_PROFILE == "llama-8b-h100"
    assert 0.005 < p.step_seconds(0, 1, 500) < 0.01  # single-stream ITL 5-10 ms


def test_unknown_profile_lists_known_names() -> None:
    with pytest.raises(KeyError, match="llama-8b-h100"):
        get_profile("nope")
