"""Endpoint picking: which of the backends that may take a request serves it, plus alternates.

Admission decides *whether* a request may go and which backends pass its tier's gates (the
candidates); this module decides *which* candidate, by a weighted score where lower wins
(weights from the policy's ``routing``): the load scorers of ``extproc.core.scorers``
(queue depth, KV-cache use, region, LoRA affinity) minus the prompt's prefix affinity, the
share of its leading blocks the backend holds (by the engine's own KV events when it
publishes them, else by what it was sent before: ``extproc.core.prefix``). The candidate
holding the longest prefix stays the choice until its load exceeds the best other's by
``sticky_margin`` (llm-d's affinity filter), so a conversation keeps its KV cache but a hot
prefix is copied onto a second backend rather than queued behind the first.

The alternates (healthy only, another region first, then least loaded) serve Envoy's retries
and hedges through override_host, which uses a listed host even when Envoy's own health
check fails it, hence healthy only. ``choose`` has the scoring in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from extproc.core.prefix import PromptBlocks
from extproc.core.scorers import Context, weighted
from extproc.fleet.backend import Backend
from extproc.policy import Routing

MAX_ALTERNATES = 2

PickReason = Literal["prefix", "load", "only", "failover"]
"""Why the first endpoint was chosen: it held the prompt's prefix within the sticky margin,
it scored best, or it was the only candidate; ``failover`` whenever it lies outside the
local region (the local backends were down, gated, full or scored worse). Bounded: a metric
label."""


@dataclass(frozen=True, slots=True)
class Pick:
    """The chosen backend first, then the alternates; and why the first."""

    backends: list[Backend]
    reason: PickReason

    @property
    def chosen(self) -> Backend:
        return self.backends[0]


def load_score(
    backend: Backend,
    routing: Routing,
    slot_limit: int,
    local_region: str,
    model: str | None = None,
) -> float:
    """Queue depth, KV-cache use, region and LoRA: the score without prefix affinity."""
    return weighted(routing).score(backend, Context(slot_limit, local_region, model))


def choose(
    candidates: Sequence[Backend],
    fleet: Sequence[Backend],
    prompt: PromptBlocks | None,
    routing: Routing,
    slot_limit: int,
    alternates_from: Sequence[Backend] | None = None,
    model: str | None = None,
) -> Pick | None:
    """The best healthy candidate for ``prompt`` and alternates from the healthy ``fleet``.

    ``candidates`` are the backends that may take the request now (gates passed, room
    left), in configured order; ties go to the earlier one, so the local region wins a tie.
    None when no candidate is healthy. ``alternates_from``: a sample of the fleet to take
    the alternates from instead of all of it (a large fleet: ``core.sampling``).

    The score:

    - the load score, the sum of the scorers of ``extproc.core.scorers`` (queue depth, KV-cache
      use, region, LoRA affinity), each weighted by its ``routing`` field;
    - prefix affinity: ``- prefix_weight * matched / blocks``, the share of the prompt's leading
      blocks this backend holds: by its own KV events when it publishes them and the engine's
      tokenizer is configured (precise), else by what it was sent before (approximate;
      ``extproc.core.prefix``).

    Sticky until saturated (llm-d's affinity filter): the candidate holding the longest prefix
    stays the choice while its load score is at most the best other candidate's plus
    ``sticky_margin``, so a conversation keeps its KV cache; beyond that it counts as saturated
    for this request and the best total score among the others wins (its prefix weight alone
    must not keep piling load on it), which copies a hot prefix onto a second backend instead of
    queueing behind the first. When precise matching stopped at one request's budget of new text
    (``extproc.fleet.pieces.COLD_CHARS``), the engines holding all that was read tie; what this
    gateway sent each of them (the approximate index) breaks the tie before load does.
    """
    usable = [b for b in candidates if b.healthy]
    if not usable:
        return None
    local = fleet[0].region if fleet else usable[0].region
    scorers, context = weighted(routing), Context(slot_limit, local, model)
    loads = {id(b): scorers.score(b, context) for b in usable}
    reason: PickReason
    if len(usable) == 1:
        best, reason = usable[0], "only"
    else:
        best, reason = _best(usable, loads, prompt, routing)
    if best.region != local:
        reason = "failover"
    pool = fleet if alternates_from is None else alternates_from
    return Pick([best, *alternates(best, pool, routing, slot_limit, local)], reason)


def _best(
    usable: list[Backend],
    loads: dict[int, float],
    prompt: PromptBlocks | None,
    routing: Routing,
) -> tuple[Backend, PickReason]:
    shares = [prefix_share(b, prompt) for b in usable]
    sent = _sent_past_the_read(usable, shares, prompt)
    holder_index = max(
        range(len(usable)), key=lambda i: (shares[i], sent[i], -loads[id(usable[i])])
    )
    if shares[holder_index] == 0.0:
        return min(usable, key=lambda b: loads[id(b)]), "load"
    holder = usable[holder_index]
    best_other = min(loads[id(b)] for b in usable if b is not holder)
    if loads[id(holder)] <= best_other + routing.sticky_margin:
        return holder, "prefix"
    others = [i for i in range(len(usable)) if i != holder_index]
    winner = min(others, key=lambda i: loads[id(usable[i])] - routing.prefix_weight * shares[i])
    return usable[winner], "load"


def _sent_past_the_read(
    usable: list[Backend], shares: list[float], prompt: PromptBlocks | None
) -> list[float]:
    """The tie-break among engines that hold all of a prompt that was read, when reading
    stopped at one request's budget of new text (``extproc.fleet.pieces.COLD_CHARS``)
    rather than at a block an engine lacks: how much of the prompt this gateway sent each
    of them (the approximate index), so a conversation stays where it went before while its
    text is read over several requests. Zeros where no such tie is."""
    none = [0.0] * len(usable)
    top = max(shares)
    if prompt is None or top == 0.0 or shares.count(top) < 2:
        return none
    sent = none.copy()
    for i, backend in enumerate(usable):
        if shares[i] != top or not backend.kv_events_live:
            continue
        keys = prompt.keys(backend.block_size)
        if keys is None or not keys.cut_short:
            continue
        sent[i] = _sent_share(backend, prompt)
    return sent


def prefix_share(backend: Backend, prompt: PromptBlocks | None) -> float:
    """The share of the prompt's leading blocks ``backend`` holds (0..1): what its KV events
    say when it publishes them, else what it was sent before (the approximate index)."""
    if prompt is None:
        return 0.0
    keys = prompt.keys(backend.block_size) if backend.kv_events_live else None
    if keys is not None:  # the engine's own truth, read only as far as it holds the prompt
        held = backend.precise_prefix(keys)
        return held / keys.total() if held else 0.0
    return _sent_share(backend, prompt)


def _sent_share(backend: Backend, prompt: PromptBlocks) -> float:
    """The share of the prompt's leading blocks this gateway sent ``backend`` lately (the
    approximate index)."""
    blocks = prompt.blocks(backend.block_size)
    if not blocks:
        return 0.0
    return backend.prefix_cache.match(blocks) / len(blocks)


def alternates(
    chosen: Backend, fleet: Sequence[Backend], routing: Routing, slot_limit: int, local: str
) -> list[Backend]:
    """Up to ``MAX_ALTERNATES`` healthy others: another region first, then least loaded.

    Alternates need not pass the gates: a retry or hedge goes out only when the first
    attempt failed or is late, and then any healthy engine beats none. They must have been
    scraped at least once: a backend whose first scrape is still pending (service start)
    counts as healthy but has not shown it answers.
    """
    others = [b for b in fleet if b is not chosen and b.healthy and b.metrics is not None]
    others.sort(
        key=lambda b: (b.region == chosen.region, load_score(b, routing, slot_limit, local))
    )
    return others[:MAX_ALTERNATES]


def pick(candidates: Sequence[Backend], fleet: Sequence[Backend]) -> list[Backend] | None:
    """``choose`` by load alone with default weights, one slot per backend (no prompt)."""
    chosen = choose(candidates, fleet, None, Routing(), 1)
    return None if chosen is None else chosen.backends
