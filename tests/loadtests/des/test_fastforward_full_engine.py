"""The decode fast-forward with requests waiting behind a full batch.

``loadtests.des`` engines spend much of a busy day with every seat taken and a request or
two waiting for one (the api tier's gate lets two wait). ``Engine.step`` admits only below
``max_num_seqs`` and never preempts to admit, so those steps are pure decode steps and
``decode_run`` takes them; this holds that against the per-step engine, through the step
where a request finishes and a waiting one is admitted.
"""

from __future__ import annotations

import copy
import math
import random

import pytest

from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, Policy
from loadtests.sim.fastforward import advance, decode_run
from loadtests.sim.profiles import get_profile


def request(rng: random.Random, n: int) -> EngineRequest:
    prompt = rng.randint(20, 200)
    output = rng.randint(10, 120)
    return EngineRequest(
        request_id=f"r{n}",
        prompt_len=prompt,
        block_hashes=[f"r{n}/{k}".encode() for k in range(prompt // 16)],
        max_tokens=output,
        output_len=output,
        priority=rng.randint(0, 30),
    )


def state(engine: Engine) -> list[tuple[object, ...]]:
    return [
        (r.request_id, r.num_computed, r.num_output, list(r.blocks), r.finish_reason)
        for r in [*engine.running, *engine.waiting]
    ] + [(engine.pool.num_free, tuple(engine.pool._free))]


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("policy", [Policy.PRIORITY, Policy.FCFS])
def test_a_request_waiting_behind_a_full_batch_lets_the_run_go_on(policy: Policy) -> None:
    rng = random.Random(7)
    config = EngineConfig(get_profile("llama-8b-l4"), max_num_seqs=4, policy=policy)
    plain = Engine(config)
    n = 0
    now = 0.0
    for _ in range(4):
        plain.add(request(rng, n), now)
        n += 1
    runs_with_waiting = 0
    fast = copy.deepcopy(plain)
    t_fast = now
    for _ in range(20_000):
        idle = not plain.has_work
        if n < 300 and (idle or (len(plain.waiting) < 3 and rng.random() < 0.5)):
            req = request(rng, n)
            n += 1
            plain.add(req, now)
            fast.add(copy.deepcopy(req), t_fast)
        if not plain.has_work:
            assert n == 300
            break
        run = decode_run(fast)
        if run is None:
            now = plain.step(now).end
            t_fast = fast.step(t_fast).end
        else:
            runs_with_waiting += bool(fast.waiting)
            assert len(fast.running) == config.max_num_seqs or not fast.waiting
            t_fast = advance(fast, run, t_fast, run.max_steps).end
            for _ in range(run.max_steps):
                out = plain.step(now)
                assert out.num_prefill_tokens == 0 and not out.num_preemptions
                now = out.end
        assert close(now, t_fast)
        assert state(fast) == state(plain)
        for f, p in zip(fast.running, plain.running, strict=True):
            assert close(f.last_token_at, p.last_token_at)
            assert close(f.prev_token_at, p.prev_token_at)
    else:
        pytest.fail("did not drain")
    assert runs_with_waiting > 30, runs_with_waiting
