"""The per-step scheduler, after vLLM 0.32's v1 ``Scheduler.schedule()``.

Everything a gateway can observe from vLLM under load comes from this loop: queueing behind
a full batch, chunked prefill slowing decodes, KV pressure, preemption, prefix-cache hits.
Each ``Engine.step`` schedules the running requests within the token budget (preempting
vLLM's victim when one cannot get a KV block), then, only if nothing was preempted, admits
waiting requests in queue order while seats, budget and blocks allow (a waiting request never
preempts a running one, and the first that does not fit stops admission), and prices the
batch with the profile. There is no I/O and no clock here: the caller passes ``now``
(simulated seconds) and gets the step's duration back, so unit tests drive the engine on a
virtual clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from loadtests.sim.blocks import BlockHash, BlockPool
from loadtests.sim.profiles import Profile


class Policy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(eq=False)
class EngineRequest:
    """One request inside the engine: its parameters, progress and timestamps."""

    request_id: str
    prompt_len: int
    block_hashes: list[BlockHash]
    max_tokens: int
    # How many tokens to generate: max_tokens, or fewer when a (simulated) EOS comes first.
    output_len: int
    priority: int = 0
    arrival: float = 0.0
    # max_tokens as the client sent it (None if absent); only reported in metrics.
    params_max_tokens: int | None = None
    # Opaque to the engine: whoever submitted the request hangs its reply channel here.
    sink: Any = None
    # The prompt's token ids, only for the KV events' BlockStored (the hashes above are what
    # the engine caches by); empty when nobody publishes events.
    token_ids: Sequence[int] = ()
    # The request's cache_salt (already in block_hashes): the KV events name it as the first
    # block's extra key.
    cache_salt: str | None = None
    # The LoRA adapter the request runs (vLLM's lora_int_id, > 0) and its name; 0 and None
    # for the base model. Its path is already in block_hashes.
    lora_id: int = 0
    lora_name: str | None = None

    seq: int = 0
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    prev_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must be in the KV cache to decode the next one."""
        return self.prompt_len + self.num_output

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.seq)

    def __lt__(self, other: EngineRequest) -> bool:
        return self.sort_key < other.sort_key


class FcfsQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def add(self, req: EngineRequest) -> None:
        self._q.append(req)

    def requeue(self, req: EngineRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> EngineRequest:
        return self._q[0]

    def pop(self) -> EngineRequest:
        return self._q.popleft()

    def remove(self, req: EngineRequest) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._q)


class PriorityQueue:
    """A heap on ``(priority, arrival)``: lower first, ties in arrival order."""

    def __init__(self) -> None:
        self._heap: list[EngineRequest] = []

    def add(self, req: EngineRequest) -> None:
        heapq.heappush(self._heap, req)

    requeue = add  # a preempted request keeps its original priority and arrival

    def peek(self) -> EngineRequest:
        return self._heap[0]

    def pop(self) -> EngineRequest:
        return heapq.heappop(self._heap)

    def remove(self, req: EngineRequest) -> None:
        self._heap.remove(req)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(sorted(self._heap))


@dataclass
class EngineConfig:
    profile: Profile
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int = 0  # 0: the profile's
    block_size: int = 16
    max_model_len: int = 0  # 0: the profile's
    policy: Policy = Policy.FCFS
    max_loras: int = 0
    """vLLM's ``--max-loras``: distinct LoRA adapters in one batch; 0: LoRA off."""
    lora_load_s: float = 0.05
    """Engine time to bring an adapter into a GPU slot (the simulator's own guess)."""

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.lora_load_s < 0:
            raise ValueError("max_loras and lora_load_s must not be negative")
        if not self.num_gpu_blocks:
            self.num_gpu_blocks = self.profile.num_gpu_blocks
        if not self.max_model_len:
            self.max_model_len = self.profile.max_model_len
        # vLLM refuses to start when one request of max_model_len cannot fit in the KV
        # cache; clamping instead keeps a small --num-gpu-blocks usable and no request can
        # wait forever for more blocks than exist.
        self.max_model_len = min(self.max_model_len, self.num_gpu_blocks * self.block_size)


@dataclass
class StepOutput:
    """What one step did; tokens become visible at ``end``."""

    start: float
    duration: float
    # Requests that produced one token in this step (``finish_reason`` set on the last one).
    outputs: list[EngineRequest]
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_lora_loads: int = 0
    """Adapters brought into a GPU slot for this step (each costs ``lora_load_s``)."""

    @property
    def end(self) -> float:
        return self.start + self.duration


class Engine:
    """Waiting queue, running batch and KV pool, advanced one step at a time.

    Each ``step(now)``:

    1. schedules the running requests in order, one decode token or the next prefill chunk each,
       within the ``max_num_batched_tokens`` budget; when a running request cannot get a KV
       block, the vLLM victim is preempted (under ``priority`` the max ``(priority, arrival)``,
       under ``fcfs`` the last running request), its blocks freed and its progress reset, and it
       goes back to the front of the waiting queue;
    2. only if nothing was preempted in this step, admits waiting requests in queue order while
       seats (``max_num_seqs``), budget and blocks allow, charging prefill only for tokens not
       already in the prefix cache. A waiting request never preempts a running one, and the
       first request that does not fit stops admission (no skipping ahead). With LoRA
       (``max_loras``), a request whose adapter would be one more than ``max_loras`` distinct
       adapters in the step's batch is skipped instead ("deferred", put back in its place) and
       admission goes on behind it, as vLLM's scheduler does;
    3. prices the batch with the profile, plus ``lora_load_s`` for each adapter of the batch
       that is not in one of the ``max_loras`` GPU slots (an LRU, as vLLM's worker keeps its
       active adapters), and advances every scheduled request, producing one token for each
       request whose prompt (and recomputed output) is fully computed.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.pool = BlockPool(config.num_gpu_blocks, config.block_size)
        self.waiting: FcfsQueue | PriorityQueue = (
            PriorityQueue() if config.policy == Policy.PRIORITY else FcfsQueue()
        )
        self.running: list[EngineRequest] = []
        self._seq = itertools.count()
        self._choose_victim: Callable[[], EngineRequest] = (
            self._priority_victim if config.policy == Policy.PRIORITY else self._fcfs_victim
        )
        self.deferred: set[EngineRequest] = set()
        """Waiting requests skipped at least once for their LoRA adapter and not admitted
        since (vLLM's ``deferred_waiting``: ``num_requests_waiting_by_reason{deferred}``)."""
        self.lora_slots: OrderedDict[int, None] = OrderedDict()
        """The adapters in the GPU slots, least recently used first (at most ``max_loras``)."""

    # -- requests in and out ---------------------------------------------------------------

    def add(self, req: EngineRequest, now: float) -> None:
        """Queue ``req``, arriving at ``now`` (simulated seconds)."""
        req.arrival = now
        req.seq = next(self._seq)
        self.waiting.add(req)

    def abort(self, req: EngineRequest, now: float) -> bool:
        """Drop ``req`` wherever it is and free its blocks; False if it had already finished."""
        if req.finish_reason is not None:
            return False
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
            self.deferred.discard(req)
        req.finish_reason = "abort"
        req.finished_at = now
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_deferred(self) -> int:
        """Waiting requests held back by the LoRA limit (counted in ``num_waiting`` too)."""
        return len(self.deferred)

    # -- LoRA slots -------------------------------------------------------------------------

    def activate_lora(self, lora_id: int) -> bool:
        """Put adapter ``lora_id`` in a GPU slot, evicting the least recently used one when
        all are taken; False if it was there already. The step that needs an adapter does
        this and pays ``lora_load_s`` for it; vLLM's ``add_lora`` (a start-up or runtime
        load) does it too, between steps, at no step's cost."""
        slots = self.lora_slots
        if lora_id in slots:
            slots.move_to_end(lora_id)
            return False
        while slots and len(slots) >= max(self.config.max_loras, 1):
            slots.popitem(last=False)
        slots[lora_id] = None
        return True

    def loras_resident(self) -> bool:
        """Whether every running request's adapter is in a slot (a step needs no load)."""
        slots = self.lora_slots
        return all(not r.lora_id or r.lora_id in slots for r in self.running)

    # -- one step -------------------------------------------------------------------------

    def step(self, now: float) -> StepOutput:
        """Schedule, price and execute one step starting at ``now``."""
        out = StepOutput(start=now, duration=0.0, outputs=[])
        budget = self.config.max_num_batched_tokens
        scheduled: dict[EngineRequest, int] = {}  # request -> tokens this step, in order
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + num_new):
                victim = self._choose_victim()
                victim_index = running.index(victim)
                del running[victim_index]
                if victim_index < i:
                    i -= 1
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                out.num_preemptions += 1
                if victim is req:
                    break
            else:
                scheduled[req] = num_new
                budget -= num_new
                i += 1
                continue
            break  # the request could not be scheduled even after preempting itself

        if not out.num_preemptions:
            self._admit_waiting(budget, scheduled, out, now)
        if self.config.max_loras:
            out.num_lora_loads = self._load_loras(scheduled)

        decode_seqs = 0
        context = 0
        for req, n in scheduled.items():
            if n == 1 and req.num_output:
                decode_seqs += 1
                context += req.num_computed
            else:
                out.num_prefill_tokens += n
            out.num_scheduled_tokens += n
        out.duration = self.profile.step_seconds(out.num_prefill_tokens, decode_seqs, context)
        if out.num_lora_loads:
            out.duration += out.num_lora_loads * self.config.lora_load_s
        self._execute(scheduled, out)
        return out

    def _admit_waiting(
        self, budget: int, scheduled: dict[EngineRequest, int], out: StepOutput, now: float
    ) -> None:
        pool = self.pool
        block_size = self.config.block_size
        max_seqs = self.config.max_num_seqs
        max_loras = self.config.max_loras
        # vLLM counts the adapters of the running requests scheduled in this step.
        loras = {r.lora_id for r in scheduled if r.lora_id} if max_loras else set()
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting.peek()
            if max_loras and req.lora_id and len(loras) >= max_loras and req.lora_id not in loras:
                # One adapter too many for this batch: skipped, and admission goes on.
                skipped.append(self.waiting.pop())
                self.deferred.add(req)
                continue
            # Reuse cached full blocks, but always compute at least the last token.
            max_hit_blocks = min((req.num_tokens - 1) // block_size, len(req.block_hashes))
            hits = pool.cached_prefix(req.block_hashes[:max_hit_blocks])
            num_cached = len(hits) * block_size
            num_new = min(req.num_tokens - num_cached, budget)
            need = -(-(num_cached + num_new) // block_size) - len(hits)
            if need + pool.num_evictable(hits) > pool.num_free:
                break
            self.waiting.pop()
            if req.lora_id:
                self.deferred.discard(req)
                loras.add(req.lora_id)
            pool.touch(hits)
            new_blocks = pool.allocate(need)
            assert new_blocks is not None
            req.blocks = hits + new_blocks
            req.num_hashed_blocks = len(hits)
            req.num_computed = num_cached
            if req.scheduled_at is None:
                req.scheduled_at = now
                req.num_cached_tokens = num_cached
            out.prefix_queries += req.num_tokens
            out.prefix_hits += num_cached
            self.running.append(req)
            scheduled[req] = num_new
            budget -= num_new
        for req in reversed(skipped):  # back in their places, ahead of the rest
            self.waiting.requeue(req)

    def _load_loras(self, scheduled: dict[EngineRequest, int]) -> int:
        """Bring the batch's adapters into the GPU slots; how many had to be loaded. Those
        already there are touched first, so a load never evicts one the batch uses."""
        batch = list(dict.fromkeys(r.lora_id for r in scheduled if r.lora_id))
        slots = self.lora_slots
        for lora_id in batch:
            if lora_id in slots:
                slots.move_to_end(lora_id)
        return sum(self.activate_lora(lora_id) for lora_id in batch)

    def _execute(self, scheduled: dict[EngineRequest, int], out: StepOutput) -> None:
        end = out.end
        pool = self.pool
        block_size = self.config.block_size
        max_model_len = self.config.max_model_len
        finished = False
        for req, n in scheduled.items():
            req.num_computed += n
            full = min(req.num_computed // block_size, len(req.block_hashes))
            if full > req.num_hashed_blocks:
                pool.cache_full(
                    req.blocks,
                    req.block_hashes,
                    req.num_hashed_blocks,
                    full,
                    req.token_ids,
                    req.cache_salt,
                    req.lora_id or None,
                    req.lora_name,
                )
                req.num_hashed_blocks = full
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk: no token yet
            req.num_output += 1
            req.prev_token_at = req.last_token_at
            req.last_token_at = end
            if req.first_token_at is None:
                req.first_token_at = end
            if req.num_output >= req.output_len or req.num_tokens >= max_model_len:
                at_limit = req.num_output >= req.max_tokens or req.num_tokens >= max_model_len
                req.finish_reason = "length" if at_limit else "stop"
                req.finished_at = end
                self._release(req)
                finished = True
            out.outputs.append(req)
        if finished:
            self.running = [r for r in self.running if r.finish_reason is None]

    # -- KV blocks and preemption -----------------------------------------------------------

    def _grow(self, req: EngineRequest, num_tokens: int) -> bool:
        """Make ``req`` hold enough blocks for ``num_tokens``; False if the pool is short."""
        need = -(-num_tokens // self.config.block_size) - len(req.blocks)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        req.blocks.extend(blocks)
        return True

    def _priority_victim(self) -> EngineRequest:
        return max(self.running, key=lambda r: (r.priority, r.arrival))

    def _fcfs_victim(self) -> EngineRequest:
        return self.running[-1]

    def _preempt(self, req: EngineRequest) -> None:
        """Recompute-style preemption: drop the KV, keep the output, requeue at the front."""
        self._release(req)
        req.num_computed = 0
        req.num_hashed_blocks = 0
        req.num_preemptions += 1
        self.waiting.requeue(req)

    def _release(self, req: EngineRequest) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
