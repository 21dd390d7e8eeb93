"""The workload is seeded: the same scenario and seed give the same requests in every arm."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

from extproc.core.prompt import count_tokens, render_chat
from extproc.policy import DEFAULT_POLICY_PATH
from loadtests.bench.scenario import Dist, Group
from loadtests.bench.workload import (
    chat_body,
    open_loop_schedule,
    prompt_text,
    sample,
    shape,
    tier_priorities,
)

GROUP = Group(
    name="chat",
    api_key="k",
    tenant="t",
    tier="interactive",
    prompt_tokens=Dist("lognormal", low=16, high=2000, median=200, sigma=0.6),
    max_tokens=Dist("uniform", low=8, high=64),
    rate=2.0,
)


def test_same_seed_same_schedule() -> None:
    first = open_loop_schedule(GROUP, seed=5, end_s=300, cap=10_000)
    again = open_loop_schedule(GROUP, seed=5, end_s=300, cap=10_000)
    other = open_loop_schedule(GROUP, seed=6, end_s=300, cap=10_000)
    assert first == again
    assert first != other
    assert [chat_body(s, GROUP, 5, "m") for s in first[:20]] == [
        chat_body(s, GROUP, 5, "m") for s in again[:20]
    ]


def test_closed_loop_shapes_are_seeded_per_client() -> None:
    closed = dataclasses.replace(GROUP, rate=None, concurrency=3)
    a = [shape(closed, 1, i, client=0) for i in range(50)]
    assert a == [shape(closed, 1, i, client=0) for i in range(50)]
    assert a != [shape(closed, 1, i, client=1) for i in range(50)]


def test_poisson_rate_window_and_cap() -> None:
    group = dataclasses.replace(GROUP, start_s=100, stop_s=900)
    schedule = open_loop_schedule(group, seed=1, end_s=1000, cap=100_000)
    times = [s.at_s for s in schedule if s.at_s is not None]
    assert min(times) >= 100 and max(times) < 900
    assert 1400 < len(times) < 1800  # 2/s over 800 s, within ~4.5 sigma
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(statistics.mean(gaps) - 0.5) < 0.05
    assert len(open_loop_schedule(group, seed=1, end_s=1000, cap=10)) == 10


def test_distributions_stay_in_bounds() -> None:
    import random

    rng = random.Random(0)
    values = [sample(GROUP.prompt_tokens, rng) for _ in range(2000)]
    assert min(values) >= 16 and max(values) <= 2000
    assert 170 < statistics.median(values) < 230
    assert {sample(Dist("fixed", value=7), rng) for _ in range(10)} == {7}


def test_prompt_text_has_the_requested_token_count() -> None:
    for tokens in (20, 100, 777):
        text = prompt_text(tokens, seed=1, group="g", client=0, index=3)
        rendered = render_chat([{"role": "user", "content": text}])
        assert count_tokens(rendered) == tokens
    # different requests do not share a prompt prefix (no accidental prefix-cache hits)
    assert prompt_text(100, 1, "g", 0, 1)[:20] != prompt_text(100, 1, "g", 0, 2)[:20]


def test_streamed_body_asks_for_usage_and_exact_lengths() -> None:
    body = chat_body(shape(GROUP, 1, 0), GROUP, 1, "sim-llama-8b")
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    plain = chat_body(shape(GROUP, 1, 0), dataclasses.replace(GROUP, stream=False), 1, "m")
    assert "stream_options" not in plain


def test_only_the_vllm_priority_arm_sends_its_tiers_priority() -> None:
    """A bare vLLM fleet's client sets ``priority`` itself; with the gateway it never does
    (the gateway decides, and strips what clients send)."""
    priorities = tier_priorities(DEFAULT_POLICY_PATH)
    assert (priorities["interactive"], priorities["batch"], priorities["low"]) == (0, 20, 20)
    item = shape(GROUP, 1, 0)
    assert "priority" not in chat_body(item, GROUP, 1, "m")
    assert chat_body(item, GROUP, 1, "m", priorities["interactive"])["priority"] == 0
