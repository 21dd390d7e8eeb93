"""The seeded workload: what each group sends, and when, identical for every arm.

An A/B comparison is only fair if both arms get the same requests. Everything random here
(Poisson arrival times, prompt and output lengths, the prompt words) comes from
``random.Random`` seeded with a string built from the scenario seed, the group name and the
request's index (string seeds hash with SHA-512, so they do not depend on
``PYTHONHASHSEED``). Open-loop groups get a fixed list of arrival times; closed-loop clients
get a fixed sequence of request shapes (how many of them run depends on the arm's speed).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from extproc.core.prompt import count_tokens, render_chat
from extproc.policy import load_policy
from loadtests.bench.scenario import Dist, Group, SharedPrefix

# Five-letter-or-shorter words are exactly one token each for extproc.core.prompt (" word").
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# Tokens the chat template adds around a user message (measured with a one-token message:
# an empty one would merge the template's two newlines into one piece).
TEMPLATE_TOKENS = count_tokens(render_chat([{"role": "user", "content": "abc"}])) - 1
# The same per role, without the closing "<|assistant|>" tag (counted once per prompt).
_REPLY_TAG = count_tokens(render_chat([]))
_ROLE_TOKENS = {
    role: count_tokens(render_chat([{"role": role, "content": "abc"}])) - 1 - _REPLY_TAG
    for role in ("system", "user", "assistant")
}


@dataclass(frozen=True)
class RequestShape:
    """One request's sizes (and for open loop its arrival, in simulated seconds)."""

    group: str
    index: int
    prompt_tokens: int
    max_tokens: int
    at_s: float | None = None
    client: int = 0
    conversation: int | None = None
    """Shared-prefix groups: the client's conversation number (None: one random message)."""
    turn: int = 0
    """Shared-prefix groups: the turn within the conversation (0 = the first)."""


def sample(dist: Dist, rng: random.Random) -> int:
    if dist.kind == "fixed":
        return dist.value
    if dist.kind == "uniform":
        return rng.randint(dist.low, dist.high)
    value = dist.median * math.exp(rng.gauss(0.0, dist.sigma))
    return max(dist.low, min(dist.high, round(value)))


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def shape(
    group: Group, seed: int, index: int, client: int = 0, at_s: float | None = None
) -> RequestShape:
    """The ``index``-th request of ``group`` (of one closed-loop ``client``)."""
    rng = _rng(seed, "shape", group.name, client, index)
    return RequestShape(
        group=group.name,
        index=index,
        prompt_tokens=sample(group.prompt_tokens, rng),
        max_tokens=sample(group.max_tokens, rng),
        at_s=at_s,
        client=client,
    )


def open_loop_schedule(group: Group, seed: int, end_s: float, cap: int) -> list[RequestShape]:
    """Poisson arrivals at ``group.rate`` between its start and ``min(stop, end_s)``."""
    assert group.rate is not None
    rng = _rng(seed, "arrivals", group.name)
    stop = min(group.stop_s if group.stop_s is not None else end_s, end_s)
    shapes: list[RequestShape] = []
    t = group.start_s
    while len(shapes) < cap:
        t += rng.expovariate(group.rate)
        if t >= stop:
            break
        shapes.append(shape(group, seed, len(shapes), at_s=t))
    return shapes


def prompt_text(prompt_tokens: int, seed: int, group: str, client: int, index: int) -> str:
    """User content whose chat rendering is ``prompt_tokens`` tokens (at least one word).

    Words are random, so prompts share no prefix blocks: prefix caching would otherwise
    make the flood's prefills nearly free and the comparison meaningless.
    """
    rng = _rng(seed, "text", group, client, index)
    return words_text(max(1, prompt_tokens - TEMPLATE_TOKENS), rng)


def words_text(words: int, rng: random.Random) -> str:
    """``words`` random words of 3-5 letters: exactly ``words`` tokens for extproc.core.prompt."""
    return " ".join("".join(rng.choices(_ALPHABET, k=rng.randint(3, 5))) for _ in range(words))


# --------------------------------------------------------------------------- shared prefixes


# Texts are cached: each turn re-sends the whole history, and regenerating ~2k random words
# per request would cost the load generator milliseconds of CPU per request.
@functools.lru_cache(maxsize=256)
def system_prompt(shared: SharedPrefix, seed: int, group: str, number: int) -> str:
    """System prompt ``number`` of a shared-prefix group: the same text in every arm and for
    every conversation that uses it (that is what makes it a shared prefix)."""
    rng = _rng(seed, "system", group, number)
    return words_text(max(1, sample(shared.system_tokens, rng)), rng)


@dataclass(frozen=True)
class Turn:
    """One turn's sizes: the new user message and the answer asked for."""

    user_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """One conversation of a closed-loop client: its system prompt and its turns' sizes."""

    client: int
    number: int
    system: int
    turns: tuple[Turn, ...]


@functools.lru_cache(maxsize=4096)
def conversation(group: Group, seed: int, client: int, number: int) -> Conversation:
    """The ``number``-th conversation of ``client`` (seeded: identical in every arm)."""
    shared = group.shared_prefix
    assert shared is not None
    rng = _rng(seed, "conversation", group.name, client, number)
    system = rng.randrange(shared.system_prompts)
    turns = tuple(
        Turn(sample(group.prompt_tokens, rng), sample(group.max_tokens, rng))
        for _ in range(max(1, sample(shared.turns, rng)))
    )
    return Conversation(client, number, system, turns)


def client_shapes(group: Group, seed: int, client: int) -> Iterator[RequestShape]:
    """The endless sequence of requests one closed-loop client sends, in order.

    Plain groups: independent requests. Shared-prefix groups: conversation after
    conversation, turn after turn; ``prompt_tokens`` is then the whole rendered history's
    size (exact for ``extproc.core.prompt``: each word is one token, the tags are counted)."""
    index = 0
    if group.shared_prefix is None:
        while True:
            yield shape(group, seed, index, client)
            index += 1
    number = 0
    while True:
        conv = conversation(group, seed, client, number)
        system_tokens = count_tokens(
            system_prompt(group.shared_prefix, seed, group.name, conv.system)
        )
        history = system_tokens + _ROLE_TOKENS["system"]
        for t, turn in enumerate(conv.turns):
            history += turn.user_tokens + _ROLE_TOKENS["user"]
            yield RequestShape(
                group=group.name,
                index=index,
                prompt_tokens=history + _REPLY_TAG,
                max_tokens=turn.max_tokens,
                client=client,
                conversation=number,
                turn=t,
            )
            history += turn.max_tokens + _ROLE_TOKENS["assistant"]
            index += 1
        number += 1


def conversation_messages(
    group: Group, seed: int, client: int, number: int, turn: int
) -> list[dict[str, str]]:
    """The messages of turn ``turn``: system prompt, the history so far, a new user message.

    The earlier answers are seeded words of the length asked for, not what an arm's backend
    actually answered, so every arm sends byte-identical prompts (the simulator's answers
    are filler anyway, and it caches only prompt blocks)."""
    shared = group.shared_prefix
    assert shared is not None
    conv = conversation(group, seed, client, number)
    messages = [{"role": "system", "content": system_prompt(shared, seed, group.name, conv.system)}]
    for t in range(turn + 1):
        user, answer = _turn_texts(group, seed, client, number, t)
        messages.append({"role": "user", "content": user})
        if t < turn:
            messages.append({"role": "assistant", "content": answer})
    return messages


@functools.lru_cache(maxsize=8192)
def _turn_texts(group: Group, seed: int, client: int, number: int, turn: int) -> tuple[str, str]:
    """Turn ``turn``'s user message and the answer that stands in for the backend's."""
    size = conversation(group, seed, client, number).turns[turn]
    rng = _rng(seed, "turn", group.name, client, number, turn)
    return words_text(size.user_tokens, rng), words_text(size.max_tokens, rng)


def chat_messages(shape: RequestShape, group: Group, seed: int) -> list[dict[str, str]]:
    """The request's messages: a conversation turn, or one random-word user message."""
    if group.shared_prefix is not None and shape.conversation is not None:
        return conversation_messages(group, seed, shape.client, shape.conversation, shape.turn)
    text = prompt_text(shape.prompt_tokens, seed, group.name, shape.client, shape.index)
    return [{"role": "user", "content": text}]


def chat_body(
    shape: RequestShape, group: Group, seed: int, model: str, priority: int | None = None
) -> dict[str, object]:
    """The request as the client sends it; ``priority`` (vLLM's body field) only where no
    gateway sets it (the ``vllm-priority`` arm)."""
    body: dict[str, object] = {
        "model": model,
        "messages": chat_messages(shape, group, seed),
        "max_tokens": shape.max_tokens,
        "ignore_eos": True,  # exact output lengths: the same work in both arms
        "stream": group.stream,
    }
    if group.stream:
        body["stream_options"] = {"include_usage": True}
    if priority is not None:
        body["priority"] = priority
    return body


def tier_priorities(policy: Path) -> dict[str, int]:
    """Each tier's base vLLM priority in ``policy``, by name and alias: what a client of a
    bare vLLM fleet would send for the work the gateway would put in that tier."""
    priorities: dict[str, int] = {}
    for tier in load_policy(policy).tiers:
        for name in (tier.name, *tier.aliases):
            priorities[name] = tier.priority
    return priorities
