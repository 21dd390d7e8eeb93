"""The per-step scheduler on a virtual clock: no sockets, no sleeping."""

from __future__ import annotations

import itertools

from loadtests.sim.blocks import block_hashes
from loadtests.sim.engine import Engine, EngineConfig, EngineRequest, Policy, StepOutput
from loadtests.sim.profiles import get_profile

_ids = itertools.count()


def make_engine(**kw: object) -> Engine:
    config = EngineConfig(profile=get_profile("llama-8b-h100"), **kw)  # type: ignore[arg-type]
    return Engine(config)


def make_req(
    tokens: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    block_size: int = 16,
    output_len: int | None = None,
) -> EngineRequest:
    if isinstance(tokens, int):
        start = next(_ids) * 100_000
        tokens = list(range(start, start + tokens))
    return EngineRequest(
        request_id=f"r{next(_ids)}",
        prompt_len=len(tokens),
        block_hashes=block_hashes(tokens, block_size),
        max_tokens=max_tokens,
        output_len=max_tokens if output_len is None else output_len,
        priority=priority,
    )


def run(engine: Engine, now: float = 0.0, max_steps: int = 10_000) -> list[StepOutput]:
    steps: list[StepOutput] = []
    while engine.has_work and len(steps) < max_steps:
        out = engine.step(now)
        now = out.end
        steps.append(out)
    return steps


def finish_order(reqs: list[EngineRequest]) -> list[str]:
    return [r.request_id for r in sorted(reqs, key=lambda r: r.finished_at or 0.0)]


def test_fcfs_serves_in_arrival_order() -> None:
    engine = make_engine(max_num_seqs=1)
    reqs = [make_req(20, priority=p) for p in (5, 0, 3)]
    for i, r in enumerate(reqs):
        engine.add(r, float(i) * 1e-6)
    run(engine)
    assert finish_order(reqs) == [r.request_id for r in reqs]


def test_priority_serves_lowest_value_first_and_ties_in_arrival_order() -> None:
    engine = make_engine(max_num_seqs=1, policy=Policy.PRIORITY)
    a, b, c, d = (make_req(20, priority=p) for p in (5, 0, 3, 0))
    for i, r in enumerate((a, b, c, d)):
        engine.add(r, float(i) * 1e-6)
    run(engine)
    assert finish_order([a, b, c, d]) == [b.request_id, d.request_id, c.request_id, a.request_id]


def test_a_waiting_high_priority_request_does_not_preempt_a_running_one() -> None:
    engine = make_engine(max_num_seqs=1, policy=Policy.PRIORITY)
    low = make_req(20, max_tokens=50, priority=10)
    engine.add(low, 0.0)
    out = engine.step(0.0)
    high = make_req(20, priority=-5)
    engine.add(high, out.end)
    run(engine, out.end)
    assert low.num_preemptions == 0
    assert high.first_token_at is not None and low.finished_at is not None
    assert high.first_token_at > low.finished_at


def _block_pressure(policy: Policy) -> tuple[EngineRequest, EngineRequest, list[StepOutput]]:
    # 6 blocks of 4 tokens; two 8-token prompts that each want 4 blocks by token 13.
    engine = make_engine(num_gpu_blocks=6, block_size=4, policy=policy)
    early_low = make_req(8, max_tokens=8, priority=5, block_size=4)
    late_high = make_req(8, max_tokens=8, priority=0, block_size=4)
    engine.add(early_low, 0.0)
    engine.add(late_high, 1e-6)
    steps = run(engine)
    assert engine.pool.num_free == 6
    return early_low, late_high, steps


def test_priority_preempts_the_lowest_priority_latest_arrival() -> None:
    early_low, late_high, steps = _block_pressure(Policy.PRIORITY)
    assert sum(s.num_preemptions for s in steps) >= 1
    assert early_low.num_preemptions >= 1 and late_high.num_preemptions == 0
    assert early_low.num_output == late_high.num_output == 8


def test_fcfs_preempts_the_last_running_request() -> None:
    early_low, late_high, _ = _block_pressure(Policy.FCFS)
    assert late_high.num_preemptions >= 1 and early_low.num_preemptions == 0


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    engine = make_engine(num_gpu_blocks=6, block_size=4, policy=Policy.PRIORITY)
    a = make_req(8, max_tokens=8, priority=5, block_size=4)
    b = make_req(8, max_tokens=8, priority=0, block_size=4)
    engine.add(a, 0.0)
    engine.add(b, 0.0)
    now = 0.0
    while not engine.step(now).num_preemptions:
        now += 0.01
    # The victim is back in the waiting queue and nothing new joined the batch.
    assert engine.num_running == 1 and engine.num_waiting == 1


def test_shared_prefix_hits_the_cache_in_full_blocks_only() -> None:
    engine = make_engine()
    shared = list(range(50))  # 3 full blocks of 16 + 2 tokens
    first = make_req([*shared, 1000, 1001])
    engine.add(first, 0.0)
    run(engine)
    second = make_req([*shared, 2000, 2001, 2002])
    engine.add(second, 1.0)
    out = engine.step(1.0)
    assert second.num_cached_tokens == 48
    assert (out.prefix_queries, out.prefix_hits) == (second.prompt_len, 48)
    assert out.num_prefill_tokens == second.prompt_len - 48


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    req = make_req(300, max_tokens=2)
    engine.add(req, 0.0)
    steps = run(engine)
    prefill_steps = [s for s in steps if s.num_prefill_tokens]
    assert [s.num_prefill_tokens for s in prefill_steps] == [64, 64, 64, 64, 44]
    assert req.first_token_at == prefill_steps[-1].end


def test_step_time_grows_with_batch_size() -> None:
    def decode_step(batch: int) -> float:
        engine = make_engine()
        for _ in range(batch):
            engine.add(make_req(100, max_tokens=10), 0.0)
        engine.step(0.0)  # prefill
        return engine.step(1.0).duration

    assert decode_step(64) > decode_step(8) > decode_step(1)


def test_output_length_is_exact_and_finish_reason_says_why() -> None:
    engine = make_engine()
    full = make_req(10, max_tokens=7)
    early = make_req(10, max_tokens=7, output_len=3)
    engine.add(full, 0.0)
    engine.add(early, 0.0)
    run(engine)
    assert (full.num_output, full.finish_reason) == (7, "length")
    assert (early.num_output, early.finish_reason) == (3, "stop")


def test_abort_frees_blocks_and_the_seat() -> None:
    engine = make_engine(num_gpu_blocks=100, max_num_seqs=1)
    running = make_req(100, max_tokens=50)
    waiting = make_req(100, max_tokens=50)
    engine.add(running, 0.0)
    engine.add(waiting, 0.0)
    engine.step(0.0)
    assert engine.pool.num_free < 100 and engine.num_running == 1
    assert engine.abort(running, 0.5) and running.finish_reason == "abort"
    assert engine.pool.num_free == 100 and engine.num_running == 0
    assert engine.abort(waiting, 0.5) and not engine.has_work
    assert not engine.abort(waiting, 0.6)
