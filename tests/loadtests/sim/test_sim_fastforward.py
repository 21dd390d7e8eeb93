"""The decode fast-forward against the per-step engine it stands for.

Each test drives two copies of one engine: one with ``Engine.step`` only, one that skips
decode runs with ``decode_run`` + ``advance`` and steps otherwise. Integer state (tokens,
block ids, the pool's free queue and hash index) must be identical; times and inter-token
latencies equal up to float rounding (the closed form sums a series the loop accumulates).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass

import pytest

from loadtests.sim.blocks import block_hashes
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, Policy, StepOutput
from loadtests.sim.fastforward import DecodeRun, advance, decode_run
from loadtests.sim.profiles import LLAMA_8B_H100, get_profile


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@dataclass(frozen=True)
class Spec:
    """One request's parameters, so that each engine copy gets its own equal request."""

    request_id: str
    tokens: tuple[int, ...]
    output_len: int
    max_tokens: int
    priority: int

    def make(self, block_size: int) -> EngineRequest:
        return EngineRequest(
            request_id=self.request_id,
            prompt_len=len(self.tokens),
            block_hashes=block_hashes(self.tokens, block_size),
            max_tokens=self.max_tokens,
            output_len=self.output_len,
            priority=self.priority,
        )


def random_spec(rng: random.Random, n: int, max_prompt: int, max_output: int) -> Spec:
    # A shared prefix now and then, so that admissions hit (and evict) cached blocks.
    prompt_len = rng.randint(1, max_prompt)
    shared = list(range(min(rng.choice((0, 0, 16, 40)), prompt_len - 1)))
    tokens = shared + [rng.randrange(1_000_000) for _ in range(prompt_len - len(shared))]
    output_len = rng.randint(1, max_output)
    return Spec(
        request_id=f"r{n}",
        tokens=tuple(tokens),
        output_len=output_len,
        max_tokens=output_len + rng.choice((0, 0, 5)),
        priority=rng.randint(0, 3),
    )


def snapshot(engine: Engine) -> tuple[object, ...]:
    """Everything integer about the engine: requests' progress and the pool, in order."""
    pool = engine.pool
    reqs = [
        (
            r.request_id,
            r.num_computed,
            r.num_output,
            list(r.blocks),
            r.num_hashed_blocks,
            r.num_preemptions,
            r.finish_reason,
        )
        for r in [*engine.running, *engine.waiting]
    ]
    return (
        reqs,
        pool.num_free,
        list(pool._free),
        dict(pool._cached),
        list(pool._hash),
        list(pool._ref),
    )


def times(r: EngineRequest) -> tuple[float | None, ...]:
    return (r.first_token_at, r.prev_token_at, r.last_token_at, r.finished_at)


def assert_same(
    fast: Engine,
    plain: Engine,
    fast_reqs: dict[str, EngineRequest],
    plain_reqs: dict[str, EngineRequest],
) -> None:
    """Same integer state (finished requests included) and the same times up to rounding."""
    assert snapshot(fast) == snapshot(plain)
    for rid, f in fast_reqs.items():
        p = plain_reqs[rid]
        assert (f.num_computed, f.num_output, len(f.blocks), f.finish_reason) == (
            p.num_computed,
            p.num_output,
            len(p.blocks),
            p.finish_reason,
        )
        for a, b in zip(times(f), times(p), strict=True):
            assert close(a, b), (rid, times(f), times(p))


class Itl:
    """Inter-token latency as ``loadtests.des.engines`` accumulates it from step outputs."""

    def __init__(self) -> None:
        self.sum_s = 0.0
        self.count = 0

    def observe(self, out: StepOutput) -> None:
        for req in out.outputs:
            if req.num_output > 1 and req.prev_token_at is not None:
                self.sum_s += out.end - req.prev_token_at
                self.count += 1


@dataclass
class Coverage:
    runs: int = 0
    kv_limited: int = 0
    finish_limited: int = 0
    cut_by_horizon: int = 0
    max_model_len_finishes: int = 0
    steps_skipped: int = 0


def random_config(rng: random.Random) -> EngineConfig:
    if rng.random() < 0.5:
        profile = LLAMA_8B_H100
        num_gpu_blocks = rng.choice((24, 40, 64, 200))
    else:
        profile = get_profile("llama-8b-l4")
        num_gpu_blocks = rng.choice((32, 80, 2500))
    return EngineConfig(
        profile=profile,
        max_num_seqs=rng.choice((4, 8, 256)),
        max_num_batched_tokens=rng.choice((64, 256, 8192)),
        num_gpu_blocks=num_gpu_blocks,
        block_size=rng.choice((4, 16)),
        max_model_len=rng.choice((0, 0, 96, 200)),
        policy=rng.choice((Policy.FCFS, Policy.PRIORITY)),
    )


def simulate(seed: int, cov: Coverage) -> None:
    """Drive a plain and a fast-forwarded copy through random arrivals until both drain."""
    rng = random.Random(seed)
    config = random_config(rng)
    plain, fast = Engine(config), Engine(copy.deepcopy(config))
    bs = config.block_size
    max_prompt = min(300, config.max_model_len - 2)
    plain_reqs: dict[str, EngineRequest] = {}
    fast_reqs: dict[str, EngineRequest] = {}
    plain_itl, fast_itl = Itl(), Itl()
    t_plain = t_fast = 0.0
    arrivals = rng.randint(3, 14)
    n = 0
    for _ in range(20_000):
        if n < arrivals and (not plain.has_work or rng.random() < 0.15):
            spec = random_spec(rng, n, max_prompt, rng.choice((8, 60, 400)))
            n += 1
            plain_reqs[spec.request_id] = p = spec.make(bs)
            fast_reqs[spec.request_id] = f = spec.make(bs)
            plain.add(p, t_plain)
            fast.add(f, t_fast)
        if not plain.has_work:
            if n >= arrivals:
                break
            continue

        run = decode_run(fast)
        if run is not None:
            assert run.max_steps >= 1
            cov.runs += 1
            if run.max_steps < run.steps_to_finish:
                cov.kv_limited += 1
            m = run.max_steps
            if rng.random() < 0.3:  # a caller's horizon (an arrival, a scrape) cuts it short
                horizon = t_fast + rng.random() * (run.end_of(m, t_fast) - t_fast)
                m = run.steps_done_by(t_fast, horizon)
                assert run.end_of(m, t_fast) <= horizon
                assert m == run.max_steps or run.end_of(m + 1, t_fast) > horizon
                cov.cut_by_horizon += 1
            done = advance(fast, run, t_fast, m)
            assert done.steps == m and done.tokens == m * run.num_seqs
            fast_itl.sum_s += done.itl_sum_s
            fast_itl.count += done.itl_count
            t_fast = done.end
            for i in range(m):
                out = plain.step(t_plain)
                assert out.num_preemptions == 0 and out.num_prefill_tokens == 0
                assert close(out.duration, run.step_seconds(i))
                assert all(r.finish_reason is None for r in out.outputs)
                assert len(out.outputs) == run.num_seqs
                plain_itl.observe(out)
                t_plain = out.end
            assert close(t_fast, t_plain), (t_fast, t_plain)
            assert_same(fast, plain, fast_reqs, plain_reqs)
            if m < run.max_steps:
                continue  # the caller would take a new decode_run after its event
            # max_steps is tight: the next step finishes a request or cannot get its blocks.
            out = plain.step(t_plain)
            finished = any(r.finish_reason is not None for r in out.outputs)
            assert finished or out.num_preemptions
            if finished:
                cov.finish_limited += 1
            plain_itl.observe(out)
            t_plain = out.end
            out = fast.step(t_fast)
            fast_itl.observe(out)
            t_fast = out.end
            cov.steps_skipped += m
        else:
            out = plain.step(t_plain)
            plain_itl.observe(out)
            t_plain = out.end
            out = fast.step(t_fast)
            fast_itl.observe(out)
            t_fast = out.end
        assert_same(fast, plain, fast_reqs, plain_reqs)
    else:
        pytest.fail(f"seed {seed}: did not drain")

    assert not fast.has_work and len(plain_reqs) == arrivals
    assert_same(fast, plain, fast_reqs, plain_reqs)
    assert fast_itl.count == plain_itl.count
    assert close(fast_itl.sum_s, plain_itl.sum_s), (fast_itl.sum_s, plain_itl.sum_s)
    cov.max_model_len_finishes += sum(
        1 for r in plain_reqs.values() if r.num_tokens >= config.max_model_len
    )


def test_fast_forward_matches_engine_step_over_random_workloads() -> None:
    cov = Coverage()
    for seed in range(40):
        simulate(seed, cov)
    # The seeds exercise every way a run ends, not only the easy one.
    assert cov.runs > 100, cov
    assert cov.kv_limited > 5, cov
    assert cov.finish_limited > 20, cov
    assert cov.cut_by_horizon > 20, cov
    assert cov.max_model_len_finishes > 2, cov
    assert cov.steps_skipped > 1000, cov


def decoding_engine(num_reqs: int = 3, output_len: int = 50, **kw: object) -> tuple[Engine, float]:
    """An engine whose requests all decode, and the time its next step starts."""
    config = EngineConfig(profile=LLAMA_8B_H100, **kw)  # type: ignore[arg-type]
    engine = Engine(config)
    for i in range(num_reqs):
        spec = Spec(f"d{i}", tuple(range(i * 1000, i * 1000 + 30 + i)), output_len, output_len, 0)
        engine.add(spec.make(config.block_size), 0.0)
    now = 0.0
    while any(r.num_output == 0 for r in engine.running) or engine.waiting:
        now = engine.step(now).end
    return engine, now


def test_a_waiting_request_refuses_the_run() -> None:
    engine, now = decoding_engine()
    assert decode_run(engine) is not None
    engine.add(Spec("w", (7,) * 20, 5, 5, 0).make(16), now)
    assert decode_run(engine) is None


def test_a_prefilling_request_refuses_the_run() -> None:
    engine, now = decoding_engine(max_num_batched_tokens=64)
    assert decode_run(engine) is not None
    engine.add(Spec("p", tuple(range(5000, 5300)), 5, 5, 0).make(16), now)
    engine.step(now)  # admitted, but only a chunk of its 300 prompt tokens fits the budget
    assert not engine.waiting
    assert any(r.num_computed < r.prompt_len for r in engine.running)
    assert decode_run(engine) is None


def test_a_run_is_refused_when_the_next_step_finishes_or_lacks_a_block() -> None:
    engine, _ = decoding_engine(output_len=2)  # one token out, the next one is the last
    assert decode_run(engine) is None
    # Prompts of 30..32 tokens in 2 + 2 + 2 blocks of 16, and no free block: the request
    # at 32 computed tokens needs a third block in the very next step.
    engine, _ = decoding_engine(num_gpu_blocks=6)
    assert engine.pool.num_free == 0
    assert decode_run(engine) is None


def test_advance_refuses_a_stale_run_or_too_many_steps() -> None:
    engine, now = decoding_engine()
    run = decode_run(engine)
    assert run is not None
    with pytest.raises(ValueError):
        advance(engine, run, now, run.max_steps + 1)
    advance(engine, run, now, 1)
    with pytest.raises(ValueError, match="stale"):
        advance(engine, run, now, 1)


def test_steps_done_by_at_exact_step_boundaries() -> None:
    engine, now = decoding_engine(num_reqs=5, output_len=400)
    real = decode_run(engine)
    assert real is not None and real.max_steps == 398
    # A huge run too, where the root of the quadratic is off by rounding.
    huge = DecodeRun(
        num_seqs=256,
        context=10**8,
        max_steps=10**9,
        steps_to_finish=10**9,
        first_step_s=LLAMA_8B_H100.step_seconds(0, 256, 10**8),
        step_growth_s=LLAMA_8B_H100.kv_read_per_token_s * 256,
    )
    flat = DecodeRun(1, 0, 1000, 1000, 0.125, 0.0)  # constant steps, exact in binary
    rng = random.Random(3)
    for run, start in ((real, now), (huge, 12_345.678), (flat, 0.0)):
        ms = [0, 1, 2, run.max_steps - 1, run.max_steps]
        ms += [rng.randint(1, run.max_steps) for _ in range(200)]
        for m in ms:
            t = run.end_of(m, start)
            assert run.steps_done_by(start, t) == m
            if m:
                assert run.steps_done_by(start, math.nextafter(t, -math.inf)) == m - 1
            if m < run.max_steps:
                assert run.steps_done_by(start, math.nextafter(t, math.inf)) == m
        assert run.steps_done_by(start, start - 1.0) == 0
        assert run.steps_done_by(start, start) == 0
        assert run.steps_done_by(start, math.inf) == run.max_steps
    assert flat.steps_done_by(0.0, 0.375) == 3


def test_speedup_of_a_thousand_step_run() -> None:
    """Not an assertion on speed: prints the figure docs/benchmarks/internals.md quotes."""
    engine, now = decoding_engine(num_reqs=64, output_len=1100)
    plain = copy.deepcopy(engine)
    t0 = time.perf_counter()
    t_plain = now
    for _ in range(1000):
        t_plain = plain.step(t_plain).end
    plain_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    run = decode_run(engine)
    assert run is not None and run.max_steps >= 1000
    done = advance(engine, run, now, 1000)
    fast_s = time.perf_counter() - t0

    assert close(done.end, t_plain)
    assert snapshot(engine) == snapshot(plain)
    print(
        f"\n1,000 decode steps of 64 requests: Engine.step {plain_s * 1e3:.1f} ms, "
        f"fast-forward {fast_s * 1e3:.2f} ms, {plain_s / fast_s:.0f}x"
    )
