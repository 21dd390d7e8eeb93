"""One round trip to Redis per period: write this replica's report, read the others'.

Everything a replica shares goes through ``EXCHANGE``, one Lua script, so a replica never
sees half of another's update and the number of round trips does not grow with traffic: one
per ``period_s`` per replica, whatever the request rate. Each replica's report is a key that
expires after the TTL, the **lease** on its requests in flight: a replica that dies stops
renewing it, and its seats come back within the TTL; a report held by another live process
makes the exchange refuse (``DuplicateReplica``). VTC and budget charges travel in a capped
stream that each replica reads past what it saw. Time is Redis's (``TIME`` inside the
script), so the replicas' clocks need not agree; everything expires once no replica
exchanges any more, and a Redis that restarts empty is refilled by the next exchanges, since
reports are whole states. ``RedisExchange`` lists the keys.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from extproc.core.budgets import Key, LedgerRow
from extproc.core.peers import ReplicaReport
from extproc.state.codec import (
    Charge,
    decode_budget_charges,
    decode_charges,
    decode_report_and_active,
)

PREFIX = "fairlane:"
STREAM_MAX = 10_000
IDLE_EXPIRY_MS = 600_000

EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prefix, me, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local replicas, charges = prefix .. 'replicas', prefix .. 'charges'
local mine = prefix .. 'report:' .. me
local held = redis.call('GET', mine)
if held then
  local holder = string.match(held, '^%d+ (%x+) ')
  if holder and holder ~= ARGV[10] then return {'duplicate', holder} end
end
redis.call('SET', mine, now .. ' ' .. ARGV[10] .. ' ' .. ARGV[4], 'PX', ttl)
redis.call('ZADD', replicas, now, me)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now - ttl)
redis.call('PEXPIRE', replicas, ARGV[7])
local out = {now, '', 0}
for _, member in ipairs(redis.call('ZRANGE', replicas, 0, -1)) do
  if member ~= me then
    local value = redis.call('GET', prefix .. 'report:' .. member)
    if value then
      table.insert(out, member)
      table.insert(out, value)
      out[3] = out[3] + 1
    end
  end
end
if ARGV[5] ~= '' or ARGV[9] ~= '' then
  local c = ARGV[5] ~= '' and ARGV[5] or '[]'
  if ARGV[9] ~= '' then
    redis.call('XADD', charges, 'MAXLEN', '~', ARGV[8], '*', 'r', me, 'c', c, 'b', ARGV[9])
  else
    redis.call('XADD', charges, 'MAXLEN', '~', ARGV[8], '*', 'r', me, 'c', c)
  end
  redis.call('PEXPIRE', charges, ARGV[7])
end
local last = ARGV[6]
if last == '' then
  local newest = redis.call('XREVRANGE', charges, '+', '-', 'COUNT', 1)
  out[2] = newest[1] and newest[1][1] or '0-0'
  return out
end
out[2] = last
for _, entry in ipairs(redis.call('XRANGE', charges, '(' .. last, '+', 'COUNT', 1000)) do
  out[2] = entry[1]
  local fields = entry[2]
  if fields[2] ~= me then
    table.insert(out, fields[4])
    table.insert(out, fields[6] or '')
  end
end
return out
"""


class DuplicateReplica(Exception):
    """Another live process writes reports under this replica's id: two replicas started
    with the same ``--replica-id`` would overwrite each other's leases every period, and
    the fleet would count only half of their requests in flight. The exchange refuses
    until the other's report expires (a restarted replica waits out its old self's TTL)."""

    def __init__(self, replica: str, holder: str) -> None:
        super().__init__(
            f"replica id {replica!r} is in use by another live process (instance {holder}); "
            "give every replica its own --replica-id"
        )


@dataclass(frozen=True, slots=True)
class Exchanged:
    """What one exchange read: the other live replicas' reports and their new charges."""

    reports: tuple[ReplicaReport, ...]
    charges: tuple[Charge, ...]
    last_charge_id: str
    """The id of the last charges entry read: where the next exchange goes on from."""
    budget_charges: tuple[LedgerRow, ...] = ()
    """The others' budget charges since the last exchange (``Budgets.charge_elsewhere``)."""
    active: dict[Key, int] = field(default_factory=dict)
    """Requests in progress on the other replicas per budgeted key, summed."""


class RedisExchange:
    """The replicas' shared state in one Redis: the only module that talks to it.

    Keys (``PREFIX`` is ``fairlane:`` by default; one Redis DB may hold several fleets with
    different prefixes):

    - ``{PREFIX}report:{replica}``: ``WRITTEN_MS INSTANCE REPORT``, the replica's report
      (``extproc.state.codec``) after Redis's time and the writing process's random instance
      token, a string that expires after ``ttl_ms``: the **lease** on its in-flight requests. A
      replica that dies stops renewing it; its seats come back within the TTL. A report held by
      another instance makes the exchange refuse (``DuplicateReplica``).
    - ``{PREFIX}replicas``: a sorted set, replica -> Redis time (ms) of its last exchange;
      members older than the TTL are pruned by the next exchange of any replica.
    - ``{PREFIX}charges``: a stream of VTC charges, one entry per exchange that had any (``r`` =
      replica, ``c`` = charges, and ``b`` = budget charges when it made any:
      ``extproc.core.budgets``), capped at about ``STREAM_MAX`` entries. Each replica reads the
      entries after the last one it saw and skips its own.

    The set and the stream expire ``IDLE_EXPIRY_MS`` after the last exchange of any replica, so
    a fleet that is gone leaves nothing behind.
    """

    def __init__(
        self,
        url: str,
        replica: str,
        ttl_s: float = 2.0,
        timeout_s: float = 0.25,
        prefix: str = PREFIX,
    ) -> None:
        self.url = url
        self.replica = replica
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.prefix = prefix
        self.instance = secrets.token_hex(6)
        """This process among any that claim the same replica id (``DuplicateReplica``)."""
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            # After Redis restarts, the pooled connection is dead: one immediate retry on
            # a fresh one makes the restart invisible. Timeouts are not retried: a slow
            # Redis must cost at most ``timeout_s`` per exchange.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        self._script = self._client.register_script(EXCHANGE)

    async def exchange(
        self, report: str, charges: str, last_charge_id: str, budget_charges: str = ""
    ) -> Exchanged:
        """Write ``report`` (and ``charges``, ``budget_charges``), read the others'.
        ``last_charge_id`` '' on the first call: charges from before this replica joined
        are not replayed."""
        args: list[str | int] = [
            self.prefix,
            self.replica,
            self.ttl_ms,
            report,
            charges,
            last_charge_id,
            IDLE_EXPIRY_MS,
            STREAM_MAX,
            budget_charges,
            self.instance,
        ]
        reply = await self._script(keys=[], args=args)
        if reply[0] == "duplicate":
            raise DuplicateReplica(self.replica, str(reply[1]))
        now_ms, last, count = int(reply[0]), str(reply[1]), int(reply[2])
        reports: list[ReplicaReport] = []
        active: Counter[Key] = Counter()
        for i in range(count):
            member, value = str(reply[3 + 2 * i]), str(reply[4 + 2 * i])
            written, _, body = value.partition(" ")
            if not body.startswith("{"):  # the writer's instance token comes first
                body = body.partition(" ")[2]
            decoded, in_progress = decode_report_and_active(
                member, body, (now_ms - int(written)) / 1000
            )
            if decoded is not None:
                reports.append(decoded)
                active.update(in_progress)
        charges_read: list[Charge] = []
        budget_read: list[LedgerRow] = []
        rest = reply[3 + 2 * count :]
        for text, budget in zip(rest[::2], rest[1::2], strict=True):
            charges_read.extend(decode_charges(str(text)))
            budget_read.extend(decode_budget_charges(str(budget)))
        return Exchanged(
            tuple(reports), tuple(charges_read), last, tuple(budget_read), dict(active)
        )

    async def close(self) -> None:
        await self._client.aclose()
