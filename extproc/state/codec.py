"""Reports and charges as bytes in Redis: compact JSON, read back without trusting it.

JSON because every replica of any version can read it and ``redis-cli`` shows it; the
reports are a few hundred bytes. ``encode_report`` gives the layout. Anything malformed
(another version, a hand-edited key) is skipped, never raised into the exchange loop.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from extproc.core.budgets import Key, LedgerRow
from extproc.core.peers import PeerBand, PreemptAsk, ReplicaReport
from extproc.fleet.shared_scrape import SharedScrape
from extproc.fleet.vllm_metrics import EngineMetrics

log = logging.getLogger("fairlane.state")

Charge = tuple[str, str, float]
"""(band, flow, cost in counter units) charged on one replica."""


def encode_report(report: ReplicaReport, active: Mapping[Key, int] | None = None) -> str:
    """``active``: the requests in progress per budgeted key (``Budgets.active``).

    A report is ``{"i": {backend: {rank: n}}, "w": {band: [n, oldest_wait_s, head_counter,
    head_flow, 1 if the head flow is fresh]}, "a": {tier: idle_s}, "s": {backend: [scraped_at,
    age_s, ok, waiting, running, kv_cache_usage, itl_sum_s, itl_count, block_size,
    num_gpu_blocks]}, "c": {backend: {rank: n}}, "p": [[replica, backend, rank, seq], ...]}``.

    ``c`` is the requests it could cancel and ``p`` its asks to other replicas to cancel one
    (``extproc.core.peers.PreemptAsk``), both left out when empty; ``"k": {backend: kv_tokens}``
    is the KV tokens of every request it sent there, a running total, left out when none; ``s``
    is the engines this replica scrapes for the fleet (``extproc.fleet.shared_scrape``):
    ``scraped_at`` is on the scraper's clock and only tells its scrapes apart, and ``itl_sum_s``
    and ``itl_count`` are both null for an engine without the ITL histogram (a replica of an
    earlier version skips such a report); ``"b": [[tenant, user|null, n], ...]`` is the requests
    it has in progress per budgeted key (``extproc.core.budgets``).

    Charges are ``[[band, flow, cost], ...]``, budget charges ``[[tenant, user|null, tokens,
    requests], ...]``.
    """
    body: dict[str, Any] = {
        "i": {
            addr: {str(r): n for r, n in ranks.items()} for addr, ranks in report.in_flight.items()
        },
        "w": {band: _band(p) for band, p in report.waiting.items()},
        "a": {tier: round(s, 3) for tier, s in report.idle_s.items() if math.isfinite(s)},
    }
    if report.scrapes:
        body["s"] = {addr: _scrape(shared) for addr, shared in report.scrapes.items()}
    if report.cancellable:
        body["c"] = {
            addr: {str(r): n for r, n in ranks.items()}
            for addr, ranks in report.cancellable.items()
        }
    if report.asks:
        body["p"] = [[a.replica, a.backend, a.rank, a.seq] for a in report.asks]
    if report.kv_tokens:
        body["k"] = dict(report.kv_tokens)
    if active:
        body["b"] = [[tenant, user, n] for (tenant, user), n in active.items()]
    return json.dumps(body, separators=(",", ":"))


def decode_report(replica: str, text: str, age_s: float) -> ReplicaReport | None:
    """The report ``replica`` wrote ``age_s`` ago, or None if it cannot be read."""
    return decode_report_and_active(replica, text, age_s)[0]


def decode_report_and_active(
    replica: str, text: str, age_s: float
) -> tuple[ReplicaReport | None, dict[Key, int]]:
    """The report and the requests in progress per budgeted key it carries ({} when it
    carries none, or cannot be read)."""
    try:
        body = _mapping(json.loads(text))
        in_flight = {
            str(addr): {int(r): int(n) for r, n in _mapping(ranks).items()}
            for addr, ranks in _mapping(body.get("i")).items()
        }
        waiting = {str(band): _peer_band(row) for band, row in _mapping(body.get("w")).items()}
        idle = {str(tier): float(s) for tier, s in _mapping(body.get("a")).items()}
        scrapes = {str(addr): _shared(row) for addr, row in _mapping(body.get("s")).items()}
        cancellable = {
            str(addr): {int(r): int(n) for r, n in _mapping(ranks).items()}
            for addr, ranks in _mapping(body.get("c")).items()
        }
        asks = tuple(
            PreemptAsk(str(to), str(addr), int(rank), int(seq))
            for to, addr, rank, seq in body.get("p") or ()
        )
        kv_tokens = {str(addr): int(n) for addr, n in _mapping(body.get("k")).items()}
        active = {_key(tenant, user): int(n) for tenant, user, n in body.get("b") or ()}
    except (ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        log.warning("skipping an unreadable report from replica %s: %s", replica, exc)
        return None, {}
    report = ReplicaReport(
        replica, in_flight, waiting, idle, max(0.0, age_s), scrapes, cancellable, asks, kv_tokens
    )
    return report, active


def _key(tenant: object, user: object) -> Key:
    return (str(tenant), None if user is None else str(user))


def _scrape(shared: SharedScrape) -> list[float | int | bool | None]:
    m = shared.metrics
    return [
        m.scraped_at,
        round(shared.age_s, 4),
        shared.ok,
        m.waiting,
        m.running,
        m.kv_cache_usage,
        m.itl_sum_s,
        m.itl_count,
        m.block_size,
        m.num_gpu_blocks,
    ]


def _shared(row: Any) -> SharedScrape:
    """A scrape row read back; ValueError for numbers no engine reports (the reader must
    not plan with a negative queue or a KV cache over full)."""
    at, age, ok, waiting, running, kv, itl_sum, itl_count, block_size, blocks = row
    if (itl_sum is None) != (itl_count is None):
        raise ValueError(f"half an ITL histogram: {row!r}")
    itl = () if itl_count is None else (itl_sum, itl_count)  # null: the engine exports none
    numbers = [float(x) for x in (age, waiting, running, kv, *itl)]
    if not all(math.isfinite(x) and x >= 0 for x in numbers) or numbers[3] > 1.0 + 1e-9:
        raise ValueError(f"scrape numbers out of range: {row!r}")
    metrics = EngineMetrics(
        waiting=numbers[1],
        running=numbers[2],
        kv_cache_usage=numbers[3],
        itl_sum_s=numbers[4] if itl else None,
        itl_count=numbers[5] if itl else None,
        scraped_at=float(at),
        block_size=None if block_size is None else int(block_size),
        num_gpu_blocks=None if blocks is None else int(blocks),
    )
    return SharedScrape(metrics, numbers[0], bool(ok))


def _band(peer: PeerBand) -> list[float | str]:
    """``[waiting, oldest_wait_s, head_counter, head_flow, 1 if fresh]`` (the head left out
    when unknown, the 1 when the head flow has been served since it arrived)."""
    row: list[float | str] = [peer.waiting, round(peer.oldest_wait_s, 4)]
    if peer.head_counter is not None and peer.head_flow is not None:
        row += [peer.head_counter, peer.head_flow]
        if peer.head_fresh:
            row.append(1)
    return row


def _peer_band(row: Any) -> PeerBand:
    if len(row) >= 4:
        fresh = len(row) >= 5 and bool(row[4])
        return PeerBand(int(row[0]), float(row[1]), float(row[2]), str(row[3]), fresh)
    return PeerBand(int(row[0]), float(row[1]))


def encode_charges(ledger: Mapping[tuple[str, str], float]) -> str:
    """This replica's charges since the last exchange ('' when there are none)."""
    if not ledger:
        return ""
    return json.dumps([[band, flow, cost] for (band, flow), cost in ledger.items()])


def decode_charges(text: str) -> list[Charge]:
    try:
        rows = json.loads(text)
        return [(str(band), str(flow), float(cost)) for band, flow, cost in rows]
    except (ValueError, TypeError) as exc:
        log.warning("skipping unreadable charges: %s", exc)
        return []


def encode_budget_charges(rows: Iterable[LedgerRow]) -> str:
    """This replica's budget charges since the last exchange ('' when there are none)."""
    rows = list(rows)
    return json.dumps(rows, separators=(",", ":")) if rows else ""


def decode_budget_charges(text: str) -> list[LedgerRow]:
    if not text:
        return []
    try:
        return [
            (*_key(tenant, user), int(tokens), int(requests))
            for tenant, user, tokens, requests in json.loads(text)
        ]
    except (ValueError, TypeError) as exc:
        log.warning("skipping unreadable budget charges: %s", exc)
        return []


def merge_budget_charges(into: dict[Key, list[int]], rows: Iterable[LedgerRow]) -> None:
    """Add budget charges to those waiting to be sent (an exchange that failed keeps them)."""
    for tenant, user, tokens, requests in rows:
        row = into.setdefault((tenant, user), [0, 0])
        row[0] += tokens
        row[1] += requests


def merge_charges(into: dict[tuple[str, str], float], charges: Iterable[Charge]) -> None:
    """Add ``charges`` to a ledger (charges an exchange could not send are kept for the next)."""
    for band, flow, cost in charges:
        into[(band, flow)] = into.get((band, flow), 0.0) + cost


def _mapping(value: object) -> Mapping[str, Any]:
    """A JSON object (``{}`` for a missing one); TypeError for anything else."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value
