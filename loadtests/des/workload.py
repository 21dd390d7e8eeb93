"""Who sends what, and when: heavy-tailed tenants, a diurnal day, power users, batch jobs.

Open-loop traffic comes from tenants picked by a Zipf law (a few send most requests, most
send almost none, as on a public API; one in ``chat_every`` is a chat app), arriving as a
Poisson process whose rate follows the day, lowest at midnight and highest at noon.
Closed-loop streams (power users at the api tier, batch jobs) keep requests outstanding and
send the next when one ends: the backlogged tenants fairness is judged on. The simulation
reads any workload through ``Traffic``: ``Workload`` here for the scale scenarios,
``loadtests.des.ab`` for an A/B bench scenario's groups. Prompts are text, as a client sends
them: the tenant's own system prompt (so the prefix cache and the picker's affinity have
something to find) and a unique tail, both of short invented words (``core.prompt`` counts
about one token per word).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Sizes:
    """A request's prompt and output tokens: uniform in ``[min, max]``."""

    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return (
            rng.randint(self.prompt_min, self.prompt_max),
            rng.randint(self.output_min, self.output_max),
        )


@dataclass(frozen=True)
class OpenLoop:
    tenants: int
    rate_per_s: float
    """Mean arrivals per simulated second over a day."""
    zipf_s: float = 1.1
    chat_every: int = 4
    amplitude: float = 0.0
    """0: a flat rate; 0.6: noon is 4x midnight."""
    day_s: float = 86_400.0
    chat: Sizes = Sizes(64, 512, 16, 128)
    api: Sizes = Sizes(128, 1024, 32, 256)
    stream_chat: bool = True


@dataclass(frozen=True)
class ClosedLoop:
    """``count`` tenants of one tier, each keeping ``concurrency`` requests outstanding
    from ``start_s`` until ``stop_s`` (then it sends nothing new: a nightly batch job)."""

    name: str
    tier: str
    count: int
    concurrency: int
    sizes: Sizes
    stream: bool = False
    start_s: float = 0.0
    stop_s: float | None = None
    """None: until the run ends."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One request a client sends."""

    tenant: str
    tier: str
    group: str
    prompt: str
    prompt_tokens: int
    prefix_tokens: int
    output_tokens: int
    max_tokens: int
    stream: bool
    api_key: str
    """The key the client sends (``authorization: Bearer KEY``): it names the tenant."""


@dataclass(frozen=True, slots=True)
class Client:
    """One closed-loop client: from ``start_s`` it sends ``next_ask()``, waits for the
    answer, pauses ``think_s`` (``refusal_pause_s`` after a refusal instead), and sends the
    next, until ``stop_s`` (None: until the run ends)."""

    tenant: str
    next_ask: Callable[[], Ask]
    start_s: float
    stop_s: float | None = None
    think_s: float = 0.0
    refusal_pause_s: float = 0.0


class Traffic(Protocol):
    """What the simulation plays: open-loop arrivals and closed-loop clients."""

    def next_arrival(self, t: float) -> float:
        """The open loop's next arrival after ``t`` (``math.inf``: none)."""
        ...

    def open_ask(self) -> Ask:
        """The request of the arrival ``next_arrival`` returned last."""
        ...

    def clients(self, start_s: float) -> list[Client]:
        """Every closed-loop client of a run starting at ``start_s``."""
        ...


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TEXT_WORDS = 200_000
PREFIX_TOKENS = 64
"""Tokens of each tenant's system prompt."""


class Workload:
    """Draws the open-loop arrivals and every request's content, from one seed.

    Open-loop tenant ``k`` of ``n`` sends in proportion to ``1 / k**zipf_s``; arrivals are
    Poisson at ``rate * (1 + amplitude * sin(2 pi (t / day - 1/4)))``, drawn by thinning (Lewis
    & Shedler). Closed-loop tenants have equal weights and ask more than they get.
    """

    def __init__(self, open_loop: OpenLoop, closed: tuple[ClosedLoop, ...], seed: int) -> None:
        self.open = open_loop
        self.closed = closed
        self.rng = random.Random(seed)
        words = {"".join(self.rng.choices(_LETTERS, k=5)) for _ in range(4000)}
        self._words = sorted(words)
        # One long text of random words; a prompt's tail is a slice of it at a random word
        # (unique enough for any cache, and O(1) to draw, unlike drawing words one by one).
        text = " ".join(self.rng.choices(self._words, k=_TEXT_WORDS))
        self._text = text
        self._starts = [0, *(i + 1 for i, c in enumerate(text) if c == " ")]
        n = open_loop.tenants
        weights = itertools.accumulate(1.0 / (k**open_loop.zipf_s) for k in range(1, n + 1))
        self._cumulative = list(weights)
        self._prefixes: dict[str, str] = {}

    # Who ---------------------------------------------------------------------------

    def open_tenants(self) -> list[tuple[str, str]]:
        """(name, tier) of every open-loop tenant, most active first."""
        every = self.open.chat_every
        return [
            (f"t{k}", "interactive" if every and k % every == 0 else "api")
            for k in range(self.open.tenants)
        ]

    def closed_tenants(self) -> list[tuple[str, str]]:
        return [(f"{c.name}{i}", c.tier) for c in self.closed for i in range(c.count)]

    def clients(self, start_s: float) -> list[Client]:
        """``concurrency`` clients per closed-loop tenant, their first sends spread over a
        second (not one instant); a refused client waits out the ``retry-after`` second.
        A job that stopped before ``start_s`` has none."""
        clients = []
        for closed in self.closed:
            if closed.stop_s is not None and closed.stop_s <= start_s:
                continue
            for i in range(closed.count):
                tenant = f"{closed.name}{i}"
                ask = functools.partial(self.closed_ask, closed, tenant)
                for k in range(closed.concurrency):
                    first = max(closed.start_s, start_s) + k / closed.concurrency
                    clients.append(Client(tenant, ask, first, closed.stop_s, 0.0, 1.0))
        return clients

    def pick_tenant(self) -> int:
        """An open-loop tenant's index, by the Zipf law."""
        total = self._cumulative[-1]
        return bisect.bisect_left(self._cumulative, self.rng.random() * total)

    # When --------------------------------------------------------------------------

    def rate_at(self, t: float) -> float:
        o = self.open
        return o.rate_per_s * (1.0 + o.amplitude * math.sin(2 * math.pi * (t / o.day_s - 0.25)))

    def next_arrival(self, t: float) -> float:
        """The open loop's next arrival after ``t`` (thinning against the peak rate)."""
        peak = self.open.rate_per_s * (1.0 + self.open.amplitude)
        if peak <= 0:
            return math.inf
        while True:
            t += self.rng.expovariate(peak)
            if self.rng.random() * peak <= self.rate_at(t):
                return t

    # What --------------------------------------------------------------------------

    def open_ask(self) -> Ask:
        k = self.pick_tenant()
        chat = bool(self.open.chat_every) and k % self.open.chat_every == 0
        sizes = self.open.chat if chat else self.open.api
        tier = "interactive" if chat else "api"
        stream = self.open.stream_chat and chat
        return self._ask(f"t{k}", tier, tier, sizes, stream)

    def closed_ask(self, loop: ClosedLoop, tenant: str) -> Ask:
        return self._ask(tenant, loop.tier, loop.name, loop.sizes, loop.stream)

    def _ask(self, tenant: str, tier: str, group: str, sizes: Sizes, stream: bool) -> Ask:
        prompt_tokens, output = sizes.draw(self.rng)
        prefix = self._prefix(tenant)
        tail = self._slice(max(1, prompt_tokens - PREFIX_TOKENS))
        return Ask(
            tenant=tenant,
            tier=tier,
            group=group,
            prompt=f"{prefix} {tail}",
            prompt_tokens=max(prompt_tokens, PREFIX_TOKENS + 1),
            prefix_tokens=PREFIX_TOKENS,
            output_tokens=output,
            max_tokens=output,
            stream=stream,
            api_key=f"sk-{tenant}",
        )

    def _slice(self, words: int) -> str:
        starts = self._starts
        first = self.rng.randrange(len(starts) - words - 1)
        return self._text[starts[first] : starts[first + words] - 1]

    def _prefix(self, tenant: str) -> str:
        prefix = self._prefixes.get(tenant)
        if prefix is None:
            prefix = self._slice(PREFIX_TOKENS)
            if len(self._prefixes) < 200_000:
                self._prefixes[tenant] = prefix
        return prefix
