"""Who sent a request, how urgent it is, and how big: ``RequestInfo`` -> ``RequestClass``.

Plain functions over the policy, with no I/O, so every decision is a unit test away. Each
refusal is a ``Rejection`` carrying the OpenAI-shaped error the client will see; the client
learns exactly what was wrong and nothing is forwarded.

Strictness: the fields read here (``model``, ``priority``, ``messages``, ``prompt``,
``max_tokens``, ``max_completion_tokens``) must have the shapes OpenAI's API gives them, or
the request is refused with a 400 naming the field, before it takes a queue slot; the gateway
routes and charges on them. Every other field is the engine's to judge.

Trust: the tier a client asks for is only a wish. The API key fixes the tenant, the tenant
fixes the most urgent tier it may use, and nothing a client sends (header, body, a rule it
can trigger) lifts a request above that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.core.body import json_kind
from extproc.core.errors import Rejection
from extproc.core.events import RequestInfo
from extproc.core.prompt import chat_text_and_tokens, count_tokens, render_chat
from extproc.policy import Policy, Rule, Tenant, Tier

ASK_HEADER = "x-priority"

MAX_TOKENS_LIMIT = 2**31 - 1
"""The largest ``max_tokens`` the gateway takes: far above any model's context, and small
enough that the fairness charge made from it up front stays an exact float."""


@dataclass(frozen=True, slots=True)
class RequestClass:
    """Everything the queues, the priority and the picker need to know about a request."""

    tenant: Tenant
    tier: Tier
    user: str
    """The end user within the tenant: fairness and the continuous priority are per user."""
    workload: str
    model: str | None
    stream: bool
    prompt_tokens: int
    """Estimated with the shared cheap tokenizer, for fairness accounting."""
    prompt_text: str
    """The prompt as the engine sees it (chat messages rendered), for prefix affinity:
    rendered once here, where its tokens are counted. Empty when the prompt has no single
    text (token ids, several prompts)."""
    body: Mapping[str, Any] | None
    """The request body as parsed, for the engine's own tokenizer when the picker matches
    prompts against the blocks engines report (``extproc.core.prefix.PromptBlocks.keys``)."""
    max_tokens: int | None
    path: str
    """The path to send upstream (a rule may have rewritten it)."""
    asked_tier: str | None
    """The tier the client asked for (canonical name), if it asked."""
    downgraded: bool
    """The request was lowered to the tenant's best tier because it asked for (or a rule
    gave it) more than the key allows."""


def authenticate(policy: Policy, info: RequestInfo) -> Tenant:
    """The tenant behind the request's API key (``Authorization: Bearer`` or ``x-api-key``)."""
    key = _api_key(info)
    if key is None:
        raise Rejection(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
            code="invalid_api_key",
        )
    tenant = policy.tenant_for_key(key)
    if tenant is None:
        raise Rejection(401, f"Incorrect API key provided: {_masked(key)}.", code="invalid_api_key")
    return tenant


def _api_key(info: RequestInfo) -> str | None:
    authorization = info.header("authorization")
    if authorization is not None:
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    header_key = (info.header("x-api-key") or "").strip()
    return header_key or None


def _masked(key: str) -> str:
    """OpenAI's style: enough of the key to recognise it, never enough to use it."""
    if len(key) < 12:
        return "***"
    return f"{key[:4]}***{key[-4:]}"


def classify(policy: Policy, info: RequestInfo, body: Mapping[str, Any]) -> RequestClass:
    """Decide tenant, tier, user, workload and size for one request (see module docstring)."""
    tenant = authenticate(policy, info)
    model = _model(body)
    asked = _asked_tier(policy, info, body)
    tier_rule, workload_rule, path_rule = _deciding_rules(policy, info, body)
    if asked is not None:
        wanted = asked
    elif tier_rule is not None and tier_rule.tier is not None:
        wanted = policy.tier(tier_rule.tier)
    else:
        wanted = policy.tier(tenant.default_tier)
    tier, downgraded = _within_allowance(policy, tenant, wanted, asked=asked is not None)
    max_tokens = _max_tokens(body)
    text, tokens = prompt_text_and_tokens(body)
    return RequestClass(
        tenant=tenant,
        tier=tier,
        user=_user(policy, info, body, tenant),
        workload=workload_rule.workload if workload_rule and workload_rule.workload else tier.name,
        model=model,
        stream=body.get("stream") is True,
        prompt_tokens=tokens,
        prompt_text=text,
        body=body,
        max_tokens=max_tokens,
        path=path_rule.rewrite(info.path) if path_rule is not None else info.path,
        asked_tier=asked.name if asked is not None else None,
        downgraded=downgraded,
    )


def _invalid_type(field: str, expected: str, value: object) -> Rejection:
    """OpenAI's words and code for a field of the wrong JSON type."""
    return Rejection(
        400,
        f"Invalid type for '{field}': expected {expected}, but got {json_kind(value)} instead.",
        code="invalid_type",
        param=field,
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _model(body: Mapping[str, Any]) -> str | None:
    """The model asked for (None: absent, the engine serves its default)."""
    model = body.get("model")
    if model is None or isinstance(model, str):
        return model
    raise _invalid_type("model", "a string", model)


def _asked_tier(policy: Policy, info: RequestInfo, body: Mapping[str, Any]) -> Tier | None:
    """The tier the client asks for: ``x-priority`` header, else a *string* body
    ``priority`` (a number there is vLLM's own field, which the gateway overwrites).

    The body's ``priority`` must be absent, null, a finite number or a tier word, whether
    or not the header decides: the gateway rewrites that field."""
    in_body = body.get("priority")
    if in_body is not None and not isinstance(in_body, str):
        if not _is_number(in_body):
            raise _invalid_type("priority", "a number or a tier name", in_body)
        if isinstance(in_body, float) and not math.isfinite(in_body):  # ints always are
            raise Rejection(
                400, "'priority' must be a finite number.", code="invalid_value", param="priority"
            )
    word = info.header(ASK_HEADER)
    if word is None or not word.strip():
        if not isinstance(in_body, str) or not in_body.strip():
            return None
        word = in_body
    elif isinstance(in_body, str) and in_body.strip():
        _tier_for_word(policy, in_body)  # a word in the body must be a tier's, header or not
    return _tier_for_word(policy, word)


def _tier_for_word(policy: Policy, word: str) -> Tier:
    """The tier ``word`` names, or the 400 listing the words there are."""
    tier = policy.tier_for_ask(word)
    if tier is None:
        known = sorted(
            {t.name for t in policy.tiers} | {a for t in policy.tiers for a in t.aliases}
        )
        raise Rejection(
            400,
            f"Unknown priority {word.strip()[:64]!r}; use one of: {', '.join(known)}.",
            code="invalid_priority",
            param="priority",
        )
    return tier


def _within_allowance(
    policy: Policy, tenant: Tenant, wanted: Tier, *, asked: bool
) -> tuple[Tier, bool]:
    """Clamp ``wanted`` to the tenant's best tier; less urgent than allowed is always fine.

    Only an explicit ask can be refused (``on_escalation: reject``): a rule match is the
    gateway's own decision, so it is quietly capped instead.
    """
    best = policy.top_tier(tenant)
    if wanted.rank >= best.rank:
        return wanted, False
    if asked and policy.on_escalation == "reject":
        raise Rejection(
            403,
            f"Tier {wanted.name!r} is not allowed for this API key; "
            f"the most urgent allowed is {best.name!r}.",
            code="tier_not_allowed",
            param="priority",
        )
    return best, True


def _deciding_rules(
    policy: Policy, info: RequestInfo, body: Mapping[str, Any]
) -> tuple[Rule | None, Rule | None, Rule | None]:
    """The first matching rule that sets the tier, the workload and the path, in one pass
    that tests each rule at most once and stops when all three are decided."""
    tier: Rule | None = None
    workload: Rule | None = None
    path: Rule | None = None
    for rule in policy.rules:
        useful = (
            (tier is None and rule.tier is not None)
            or (workload is None and rule.workload is not None)
            or (path is None and rule.rewrites_path)
        )
        if not useful or not rule.match.matches(info.path, info.headers, body):
            continue
        if tier is None and rule.tier is not None:
            tier = rule
        if workload is None and rule.workload is not None:
            workload = rule
        if path is None and rule.rewrites_path:
            path = rule
        if tier is not None and workload is not None and path is not None:
            break
    return tier, workload, path


def _user(policy: Policy, info: RequestInfo, body: Mapping[str, Any], tenant: Tenant) -> str:
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    return info.header(policy.user_header) or tenant.name


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) or else ``max_tokens``; both are
    checked when both are sent."""
    found: int | None = None
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid_type(field, "an integer", value)
        if not 0 <= value <= MAX_TOKENS_LIMIT:
            raise Rejection(
                400,
                f"Invalid '{field}': expected an integer from 0 to {MAX_TOKENS_LIMIT}, "
                f"but got {str(value)[:32]} instead.",
                code="invalid_value",
                param=field,
            )
        if found is None:
            found = value
    return found


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """Estimated prompt size: chat ``messages``, completion ``prompt`` or ``input``."""
    return prompt_text_and_tokens(body)[1]


def prompt_text_and_tokens(body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt's text (for prefix affinity) and its estimated size, rendering once."""
    messages = body.get("messages")
    if messages is not None:
        _check_messages(messages)
        return chat_text_and_tokens(messages)
    for field in ("prompt", "input"):
        value = body.get(field)
        if value is not None:
            return _single_text(value), _text_tokens(value, field)
    return "", 0


def _check_messages(messages: object) -> None:
    """Chat ``messages``: an array of objects, each ``content`` a string, an array of
    content parts (objects) or null; what the parts hold is the engine's to judge."""
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array of objects", messages)
    for i, message in enumerate(messages):  # dict, not Mapping: 4x faster, and JSON's type
        if not isinstance(message, dict):
            raise _invalid_type(f"messages[{i}]", "an object", message)
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            expected = "a string, an array of content parts or null"
            raise _invalid_type(f"messages[{i}].content", expected, content)
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _invalid_type(f"messages[{i}].content[{j}]", "an object", part)


def _single_text(value: Any) -> str:
    """The one text a ``prompt``/``input`` holds, or "" when it is ids or several texts
    (each of several prompts has its own prefix; no one backend suits them all)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return ""


_PROMPT_SHAPES = "a string, an array of strings, of token ids or of token-id arrays"


def _text_tokens(value: Any, field: str) -> int:
    """A string, a list of strings, token ids, or a list of token-id lists (OpenAI shapes).

    ``prompt`` in any other shape is refused (param ``prompt`` or the element, such as
    ``prompt[2]``); ``input`` (Responses, embeddings) comes in many shapes and is sized as
    unknown when it has none of these."""
    if isinstance(value, str):
        return count_tokens(value)
    if not isinstance(value, list):
        if field == "prompt":
            raise _invalid_type("prompt", _PROMPT_SHAPES, value)
        return 0
    total = 0
    for i, item in enumerate(value):
        if isinstance(item, str):
            total += count_tokens(item)
        elif _is_token_id(item):
            total += 1
        elif isinstance(item, list) and all(_is_token_id(token) for token in item):
            total += len(item)
        elif isinstance(item, Mapping) and field == "input":  # a Responses API item
            total += count_tokens(render_chat([item]))
        elif field == "prompt":
            raise _invalid_type(f"prompt[{i}]", "a string, a token id or a token-id array", item)
        else:
            return 0
    return total


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
