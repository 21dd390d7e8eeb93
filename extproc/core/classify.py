"""Who sent a request, how urgent it is, and how big: ``RequestInfo`` -> ``RequestClass``.

Plain functions over the policy, with no I/O, so every decision is a unit test away. Each
refusal is a ``Rejection`` carrying the OpenAI-shaped error the client will see; the client
learns exactly what was wrong and nothing is forwarded.

Trust: the tier a client asks for is only a wish. The API key fixes the tenant, the tenant
fixes the most urgent tier it may use, and nothing a client sends (header, body, a rule it
can trigger) lifts a request above that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.core.errors import Rejection
from extproc.core.events import RequestInfo
from extproc.core.prompt import count_tokens, render_chat
from extproc.policy import Policy, Rule, Tenant, Tier

ASK_HEADER = "x-priority"
_BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


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
    max_tokens: int | None
    path: str
    """The path to send upstream (a rule may have rewritten it)."""
    asked_tier: str | None
    """The tier the client asked for (canonical name), if it asked."""
    downgraded: bool
    """The request was lowered to the tenant's best tier because it asked for (or a rule
    gave it) more than the key allows."""


def parse_body(policy: Policy, info: RequestInfo) -> dict[str, Any]:
    """The request body as a JSON object, or the 4xx that explains why it is not one."""
    if info.invalid_headers:
        names = ", ".join(sorted(info.invalid_headers))
        raise Rejection(
            400, f"Header values must be valid UTF-8; invalid: {names}.", code="invalid_header"
        )
    size = len(info.body)
    if size > policy.max_body_bytes:
        raise Rejection(
            413,
            f"Request body is {size} bytes; the limit is {policy.max_body_bytes} bytes.",
            code="request_too_large",
        )
    if not info.body:
        if info.method.upper() in _BODILESS_METHODS:
            return {}
        raise Rejection(
            400, "The request body is empty; expected a JSON object.", code="invalid_json"
        )
    try:
        body = json.loads(info.body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Rejection(
            400,
            f"We could not parse the JSON body of your request ({_reason(exc)}). "
            "The API expects a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise Rejection(
            400,
            f"The request body must be a JSON object, not {_json_kind(body)}.",
            code="invalid_json",
        )
    return body


def _reason(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return "the body is not valid UTF-8"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)


def _json_kind(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


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
    model = body.get("model")
    text, tokens = prompt_text_and_tokens(body)
    return RequestClass(
        tenant=tenant,
        tier=tier,
        user=_user(policy, info, body, tenant),
        workload=workload_rule.workload if workload_rule and workload_rule.workload else tier.name,
        model=model if isinstance(model, str) else None,
        stream=body.get("stream") is True,
        prompt_tokens=tokens,
        prompt_text=text,
        max_tokens=max_tokens,
        path=path_rule.rewrite(info.path) if path_rule is not None else info.path,
        asked_tier=asked.name if asked is not None else None,
        downgraded=downgraded,
    )


def _asked_tier(policy: Policy, info: RequestInfo, body: Mapping[str, Any]) -> Tier | None:
    """The tier the client asks for: ``x-priority`` header, else a *string* body
    ``priority`` (a number there is vLLM's own field, which the gateway overwrites)."""
    word = info.header(ASK_HEADER)
    if word is None or not word.strip():
        in_body = body.get("priority")
        if not isinstance(in_body, str) or not in_body.strip():
            return None
        word = in_body
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
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Rejection(
                400,
                f"'{field}' must be a non-negative integer, not {json.dumps(value)[:64]}.",
                code="invalid_value",
                param=field,
            )
        return value
    return None


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """Estimated prompt size: chat ``messages``, completion ``prompt`` or ``input``."""
    return prompt_text_and_tokens(body)[1]


def prompt_text_and_tokens(body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt's text (for prefix affinity) and its estimated size, rendering once."""
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise Rejection(
                400,
                "'messages' must be an array of objects.",
                code="invalid_value",
                param="messages",
            )
        text = render_chat(messages)
        return text, count_tokens(text)
    for field in ("prompt", "input"):
        if field in body:
            value = body[field]
            return _single_text(value), _text_tokens(value, field)
    return "", 0


def _single_text(value: Any) -> str:
    """The one text a ``prompt``/``input`` holds, or "" when it is ids or several texts
    (each of several prompts has its own prefix; no one backend suits them all)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return ""


def _text_tokens(value: Any, field: str) -> int:
    """A string, a list of strings, token ids, or a list of token-id lists (OpenAI shapes)."""
    if isinstance(value, str):
        return count_tokens(value)
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, str):
                total += count_tokens(item)
            elif isinstance(item, int) and not isinstance(item, bool):
                total += 1
            elif isinstance(item, list):
                total += len(item)
            elif isinstance(item, Mapping) and field == "input":  # a Responses API item
                total += count_tokens(render_chat([item]))
            elif field == "prompt":
                break  # not a shape we know; fall through to the error below
        else:
            return total
    if field == "input":
        return 0  # Responses/embeddings inputs come in many shapes; size them as unknown
    raise Rejection(
        400,
        "'prompt' must be a string, an array of strings or of token ids.",
        code="invalid_value",
        param="prompt",
    )
