"""Closed-form runs of identical decode-only engine steps.

A simulated day of 1,000 engines is billions of ``Engine.step`` calls if every decode step is
simulated one by one, yet most of those steps are alike: nothing can be admitted, every
running request decodes one token, nobody finishes and the KV pool has room. Between two
events that change the batch, such a run is arithmetic: step ``i`` lasts ``a + i * g`` (its
context grows by one token per request), and blocks are taken from the pool in the per-step
engine's order, so the engine ends exactly as after ``m`` calls of ``Engine.step``.
``decode_run`` says whether such a run is possible now and how long, ``advance`` applies it,
and ``view`` answers a scrape in the middle of one; ``loadtests.des.engines`` jumps each
simulated engine over such stretches, tens of times faster than stepping
(docs/benchmarks/internals.md). The arithmetic assumes ``Profile.step_seconds`` is the linear
model it states; ``tests/loadtests/sim/test_sim_fastforward.py`` holds the fast-forward
against ``Engine.step``, so a change there shows up.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from loadtests.sim.engine import Engine


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """A run of decode-only steps the engine can take from its current state."""

    num_seqs: int
    """``D``: the running requests, each producing one token per step."""
    context: int
    """``C``: the sum of their ``num_computed`` at the run's start."""
    max_steps: int
    """Steps that may be skipped: before any finishing step, within KV, no prompt caching."""
    steps_to_finish: int
    """Index of the first step in which a request finishes (``>= max_steps``)."""
    first_step_s: float
    """Duration of step 0, ``step_seconds(0, D, C)``."""
    step_growth_s: float
    """How much longer each step is than the one before (``D`` more context tokens)."""

    def step_seconds(self, i: int) -> float:
        """Duration of step ``i`` (0-based) of the run."""
        return self.first_step_s + i * self.step_growth_s

    def end_of(self, m: int, start: float) -> float:
        """When the ``m``-th step ends (``start`` for ``m == 0``), the run starting at ``start``."""
        return start + m * self.first_step_s + self.step_growth_s * (m * (m - 1) // 2)

    def steps_done_by(self, start: float, t: float) -> int:
        """How many of the ``max_steps`` skippable steps have ended by ``t`` (``end <= t``).

        The quadratic gives an estimate; ``end_of`` then settles it, so a ``t`` that is
        exactly some ``end_of(m, start)`` counts step ``m`` whatever the rounding of the root.
        """
        limit = self.max_steps
        elapsed = t - start
        if limit == 0 or elapsed < self.first_step_s:
            return 0
        a, half_g = self.first_step_s, self.step_growth_s / 2
        # elapsed = half_g * m**2 + (a - half_g) * m; the root in its cancellation-free form.
        b = a - half_g
        if half_g > 0:
            estimate = 2 * elapsed / (b + math.sqrt(b * b + 4 * half_g * elapsed))
        elif a > 0:
            estimate = elapsed / a
        else:  # steps that take no time: every one has ended
            return limit
        m = limit if not estimate < limit else max(0, int(estimate))
        while m > 0 and self.end_of(m, start) > t:
            m -= 1
        while m < limit and self.end_of(m + 1, start) <= t:
            m += 1
        return m


@dataclass(frozen=True, slots=True)
class DecodeAdvance:
    """What ``m`` skipped steps produced, as the per-step loop would have reported it."""

    steps: int
    end: float
    """When the last skipped step ended: where the next ``Engine.step`` starts."""
    tokens: int
    """Tokens generated (``D`` per step; ``vllm:generation_tokens``)."""
    itl_sum_s: float
    """Sum of the inter-token gaps of those tokens (each one's end minus its request's last)."""
    itl_count: int
    """How many gaps (every token here follows its request's first; see ``advance``)."""


def decode_run(engine: Engine) -> DecodeRun | None:
    """The run of decode-only steps the engine can skip from now, or ``None`` if none.

    ``None`` when a request waits and a seat is free (the next step would admit it, or
    defer it for its LoRA adapter; with every seat taken a waiting request changes no step
    until one finishes, as the per-step engine only admits below ``max_num_seqs`` and never
    preempts to admit), when a running request is prefilling (or recomputing after a
    preemption), when the batch exceeds the token budget, when a running request's LoRA
    adapter is not in a slot (a runtime load evicted it), or when not even one step can be
    skipped (a request finishes in the next step, or the pool cannot supply its blocks).

    The arithmetic: step ``i`` (0-based) schedules the same ``D`` requests, one token each, over
    a context of ``C + i * D`` tokens (each request's ``num_computed`` grows by one per step),
    so it lasts ``profile.step_seconds(0, D, C + i * D) = a + i * g`` with ``a = base +
    decode_per_seq * D + kv_read_per_token * C`` and ``g = kv_read_per_token * D``; the ``m``-th
    step ends at ``start + m * a + g * m * (m - 1) / 2``; each request gains ``m`` tokens and
    the KV blocks that ``ceil(tokens / block_size)`` asks for, taken from the pool in the order
    the per-step engine takes them (step by step, in running order), so block ids, the pool's
    free queue and its prefix-cache evictions end up exactly as after ``m`` calls of
    ``Engine.step``.

    A run stops strictly before any request's finishing step (that step frees blocks and changes
    the batch, so the caller runs it with ``Engine.step``), within the free blocks (a step that
    cannot get a block preempts) and before any prompt block would be cached.

    KV events need nothing here: a run caches no prompt block (the simulator hashes prompts
    only, so decode blocks are never cached), and every block it takes comes from
    ``pool.allocate``, which queues the ``BlockRemoved`` of each cached block it evicts, in the
    per-step loop's order. A caller that publishes would send a run's evictions as one batch
    instead of one per step; the only caller, ``loadtests.des``, publishes none (its pools do
    not ``record_events``).
    """
    running = engine.running
    if not running:
        return None
    config = engine.config
    if engine.waiting and len(running) < config.max_num_seqs:
        return None
    if len(running) > config.max_num_batched_tokens:
        return None
    if config.max_loras and not engine.loras_resident():
        return None  # the next step loads an adapter: longer than the run's arithmetic
    block_size = config.block_size
    max_model_len = config.max_model_len
    context = 0
    to_finish = max_model_len  # no request can go on for more steps than this
    uncached = max_model_len  # steps before a prompt block would be cached
    for req in running:
        computed = req.num_computed
        if req.num_output < 1 or req.prompt_len + req.num_output - computed != 1:
            return None
        if len(req.blocks) * block_size < computed:
            return None  # fewer blocks than computed tokens: never so after a step
        context += computed
        # After step i, num_output is num_output + i + 1: the first finishing step's index.
        finish = min(req.output_len, max_model_len - req.prompt_len) - req.num_output - 1
        if finish < 1:
            return None  # the next step finishes it (the commonest refusal: say so early)
        to_finish = min(to_finish, finish)
        if len(req.block_hashes) > req.num_hashed_blocks:
            # _execute caches block k once num_computed reaches (k + 1) * block_size; the
            # prompt's blocks are hashed before it decodes, so this is only a safeguard.
            uncached = min(uncached, (req.num_hashed_blocks + 1) * block_size - computed - 1)
    limit = _within_blocks(engine, min(to_finish, uncached))
    if limit < 1:
        return None
    profile = engine.profile
    num_seqs = len(running)
    return DecodeRun(
        num_seqs=num_seqs,
        context=context,
        max_steps=limit,
        steps_to_finish=to_finish,
        first_step_s=profile.step_seconds(0, num_seqs, context),
        step_growth_s=profile.kv_read_per_token_s * num_seqs,
    )


@dataclass(frozen=True, slots=True)
class DecodeView:
    """What the per-step loop shows at a time ``t`` inside a run, the engine left unchanged.

    An event-driven caller (``loadtests.des.engines``) runs ``Engine.step`` at a step's
    start and publishes its tokens at its end, so at ``t`` the step in progress has already
    taken its blocks but its inter-token gaps are not counted yet. A scrape in the middle of
    a run reads this instead of cutting the run short.
    """

    ended: int
    """Steps of the run whose end is ``<= t`` (their tokens are out)."""
    applied: int
    """Steps the per-step engine has executed by ``t``: the ended ones and the one running."""
    num_free: int
    """The pool's free blocks after ``applied`` steps (``kv_cache_usage_perc`` reads it)."""
    itl_sum_s: float
    """Inter-token gaps of the ``ended`` steps' tokens (``advance``'s arithmetic)."""
    itl_count: int


class RunViewer:
    """``view`` of one run at many times: O(D + blocks) once, then O(log) per time.

    A scrape round reads every engine every 0.1 s, and a stretch of a 16-seat engine lasts
    seconds, so the same run is viewed tens of times; what does not depend on the time (the
    first step's inter-token gaps, the step in which each new block is taken) is worked out
    here once.
    """

    def __init__(self, engine: Engine, run: DecodeRun, start: float) -> None:
        self.run = run
        self.start = start
        self._free = engine.pool.num_free
        first_end = run.end_of(1, start)
        self._first_end = first_end
        gaps = [first_end - r.last_token_at for r in engine.running if r.last_token_at is not None]
        self._first_sum = sum(gaps)
        self._first_count = len(gaps)
        # Request r takes block number len(blocks) + j in the step index num_computed + i + 1
        # first exceeds (len(blocks) + j) * block_size (``advance``'s order, without ids).
        block_size = engine.config.block_size
        keys: list[int] = []
        for req in engine.running:
            first = len(req.blocks) * block_size - req.num_computed  # >= 0 (decode_run)
            keys.extend(range(first, run.max_steps, block_size))
        keys.sort()
        self._block_steps = keys

    def at(self, t: float) -> DecodeView:
        run, start = self.run, self.start
        ended = run.steps_done_by(start, t)
        applied = min(ended + 1, run.max_steps)
        itl_sum = 0.0
        itl_count = 0
        if ended:
            itl_sum = self._first_sum + run.num_seqs * (run.end_of(ended, start) - self._first_end)
            itl_count = self._first_count + run.num_seqs * (ended - 1)
        return DecodeView(
            ended=ended,
            applied=applied,
            num_free=self._free - bisect.bisect_left(self._block_steps, applied),
            itl_sum_s=itl_sum,
            itl_count=itl_count,
        )


def view(engine: Engine, run: DecodeRun, start: float, t: float) -> DecodeView:
    """The run started at ``start`` as the per-step loop would show it at ``t``."""
    return RunViewer(engine, run, start).at(t)


def _blocks_needed(engine: Engine, m: int) -> int:
    """Blocks the running requests take from the pool over ``m`` decode steps (``_grow``)."""
    block_size = engine.config.block_size
    total = 0
    for req in engine.running:
        need = -(-(req.num_computed + m) // block_size) - len(req.blocks)
        if need > 0:
            total += need
    return total


def _within_blocks(engine: Engine, limit: int) -> int:
    """The most steps, at most ``limit``, whose block growth the pool can supply.

    Nothing is freed during the run, so a step preempts exactly when the blocks taken so
    far exceed ``pool.num_free`` (free blocks, cached or not: ``allocate`` evicts cached
    ones). That total only grows with the steps, hence the bisection.
    """
    free = engine.pool.num_free
    if limit < 1 or _blocks_needed(engine, limit) <= free:
        return limit
    lo, hi = 0, limit  # _blocks_needed(lo) <= free < _blocks_needed(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _blocks_needed(engine, mid) <= free:
            lo = mid
        else:
            hi = mid
    return lo


def advance(engine: Engine, run: DecodeRun, start: float, m: int) -> DecodeAdvance:
    """Apply ``m`` steps of ``run`` (from ``decode_run(engine)``, starting at ``start``).

    The engine ends as ``m`` calls of ``engine.step`` starting at ``start`` would leave it:
    each running request has ``m`` more tokens computed and generated, the blocks they
    needed (the same block ids, taken in the same order), and ``prev_token_at`` /
    ``last_token_at`` at the ends of the last two steps. ``run`` is only valid for the
    state it was computed from: call ``decode_run`` again after any other change.

    What it reports is what the per-step loop would have: the end time, the tokens produced and
    the inter-token latencies (the sum and count a ``/metrics`` scrape reads, as
    ``loadtests.des.engines`` and ``loadtests.sim.metrics`` observe them: one gap per token
    after a request's first). It costs O(D) plus one pool allocation per new block (``D * m /
    block_size`` of them, about half its time, kept so that block ids match); the plain loop
    costs O(D) per step.
    """
    if not 0 <= m <= run.max_steps:
        raise ValueError(f"m={m} outside 0..{run.max_steps}")
    running = engine.running
    if (
        (engine.waiting and len(running) < engine.config.max_num_seqs)
        or len(running) != run.num_seqs
        or sum(r.num_computed for r in running) != run.context
    ):
        raise ValueError("stale DecodeRun: the engine changed since decode_run")
    if m == 0:
        return DecodeAdvance(steps=0, end=start, tokens=0, itl_sum_s=0.0, itl_count=0)

    # Block growth, in the per-step engine's order: step by step, running order within a
    # step. Request r's block number len(blocks) + j is first needed in the step in which
    # num_computed + i + 1 exceeds (len(blocks) + j) * block_size.
    block_size = engine.config.block_size
    num_seqs = run.num_seqs
    order: list[int] = []  # step * num_seqs + index in running, one per block
    stride = block_size * num_seqs  # a request needs a block every block_size steps
    for idx, req in enumerate(running):
        held = len(req.blocks)
        need = -(-(req.num_computed + m) // block_size) - held
        if need > 0:
            # The step of its first new block: >= 0, as decode_run checks blocks cover tokens.
            key = (held * block_size - req.num_computed) * num_seqs + idx
            order.extend(range(key, key + need * stride, stride))
    if order:
        order.sort()
        blocks = engine.pool.allocate(len(order))
        assert blocks is not None, "decode_run keeps a run within the free blocks"
        append = [req.blocks.append for req in running]
        for key, block in zip(order, blocks, strict=True):
            append[key % num_seqs](block)

    first_end = run.end_of(1, start)
    end = run.end_of(m, start)
    prev_end = run.end_of(m - 1, start)
    itl_sum = 0.0
    itl_count = 0
    for req in running:
        last = req.last_token_at
        if last is not None:  # the per-step loop skips a gap with no previous token too
            itl_sum += first_end - last
            itl_count += 1
        if req.first_token_at is None:
            req.first_token_at = first_end
        req.prev_token_at = last if m == 1 else prev_end
        req.last_token_at = end
        req.num_computed += m
        req.num_output += m
    if m > 1:  # steps 1..m-1: every request's gap is that step's duration; they telescope
        itl_sum += num_seqs * (end - first_end)
        itl_count += num_seqs * (m - 1)
    return DecodeAdvance(
        steps=m, end=end, tokens=num_seqs * m, itl_sum_s=itl_sum, itl_count=itl_count
    )
