"""A request as vLLM 0.32 reads it: the body's checks, its errors, and what the engine needs.

Plain functions over dicts and bytes, no aiohttp, so vLLM's validation can be tested and
compared with the real server without a socket. vLLM answers two kinds of 400, and both are
kept apart here because clients (and the conformance tests) see the difference: pydantic's
request-validation failures before any handler runs, and the serving code's own checks.
The bodies that go back are rendered in :mod:`loadtests.sim.response`.
"""

from __future__ import annotations

import json
import random
import uuid
import zlib
from array import array
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.core.prefix import PromptTokenizer
from extproc.core.prompt import render_chat, tokenize

PRIORITY_HEADER = "x-vllm-priority"

# The median and spread of simulated natural answer lengths (tokens) when no max_tokens
# stops the answer first: a log-normal, roughly matching chat-style outputs (ShareGPT's
# median output is about 200 tokens).
NATURAL_LEN_MEDIAN = 200
NATURAL_LEN_SIGMA = 0.9
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``CompletionRequest.max_tokens`` default (chat has none: the model length)."""


CACHE_SALT_MAX_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
"""vLLM 0.32's ``validate_cache_salt``: at most 128 characters, none of ``@ / \\`` or NUL."""


class ApiError(Exception):
    """An error answered in vLLM's ``ErrorResponse`` shape.

    vLLM 0.32 answers two kinds of 400: request-validation failures (pydantic, before the
    handler runs) with ``type: "Bad Request"`` and ``param`` the first error's location
    (``"body.priority"``, ``"body.31"`` for JSON that breaks at character 31), and checks in
    the serving code with ``type: "BadRequestError"`` and ``param`` the parameter's name.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


def _input_repr(value: Any) -> str:
    """How vLLM's validation message shows an offending input."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """vLLM's answer to a body that fails request validation: ``"N validation error(s)"``.

    Each error is pydantic's ``{type, loc, msg, input[, ctx]}`` with ``loc`` dotted and the
    input shortened as vLLM does; ``param`` is the first error's location.
    """
    count = len(errors)
    lines = [f"{count} validation error{'s' if count != 1 else ''}:"]
    lines += [f"  {error!r}" for error in errors]
    return ApiError("\n".join(lines), err_type="Bad Request", param=str(errors[0]["loc"]))


def _field_error(kind: str, name: str, msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": f"body.{name}", "msg": msg, "input": _input_repr(value)}


@dataclass
class GenerateRequest:
    """A parsed chat or completions request with everything the engine needs."""

    chat: bool
    model: str
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # effective: the parameter, or what is left of the model length
    params_max_tokens: int | None  # as sent
    output_len: int
    stream: bool
    include_usage: bool
    priority: int
    body_priority: int | None
    header_priority: int | None
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter the request's ``model`` names; None for a served model name."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# --------------------------------------------------------------------------- validation

_INT_MSG = "Input should be a valid integer"


def _int_error(value: Any, name: str) -> dict[str, Any] | None:
    """Pydantic-lax int check (ints, bools, integral floats and numeric strings pass)."""
    if isinstance(value, (bool, int)):
        return None
    if isinstance(value, float):
        if value.is_integer():
            return None
        return _field_error(
            "int_from_float", name, f"{_INT_MSG}, got a number with a fractional part", value
        )
    if isinstance(value, str):
        try:
            if float(value.strip()).is_integer():
                return None
        except ValueError:
            pass
        return _field_error(
            "int_parsing", name, f"{_INT_MSG}, unable to parse string as an integer", value
        )
    return _field_error("int_type", name, _INT_MSG, value)


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    """An integer field already validated by ``_validate``; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    return int(float(value)) if isinstance(value, str) else int(value)


# The message types vLLM's ChatCompletionRequest accepts, in the order pydantic tries them.
_MESSAGE_PARAMS = (
    "ChatCompletionDeveloperMessageParam",
    "ChatCompletionSystemMessageParam",
    "ChatCompletionUserMessageParam",
    "ChatCompletionAssistantMessageParam",
    "ChatCompletionToolMessageParam",
    "ChatCompletionFunctionMessageParam",
    "CustomChatCompletionMessageParam",
)
_INT_FIELDS = ("n", "max_tokens", "max_completion_tokens", "min_tokens", "priority", "seed")


def _message_errors(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Pydantic's complaints about a chat body's ``messages``: one per message type it
    tried, for each message that is not an object."""
    messages = body.get("messages")
    if "messages" not in body:
        return [
            {
                "type": "missing",
                "loc": "body.messages",
                "msg": "Field required",
                "input": _input_repr(dict(body)),
            }
        ]
    if messages is not None and not isinstance(messages, list):
        return [_field_error("list_type", "messages", "Input should be a valid list", messages)]
    errors: list[dict[str, Any]] = []
    for i, message in enumerate(messages or []):
        if isinstance(message, dict):
            continue
        shown = _input_repr(message)
        errors += [
            {
                "type": "dict_type",
                "loc": f"body.messages.{i}.{cls}",
                "msg": "Input should be a valid dictionary",
                "input": shown,
            }
            for cls in _MESSAGE_PARAMS
        ]
        errors.append(
            {
                "type": "model_attributes_type",
                "loc": f"body.messages.{i}.Message",
                "msg": "Input should be a valid dictionary or object to extract fields from",
                "input": shown,
            }
        )
    return errors


def _check_cache_salt(salt: Any) -> None:
    """vLLM 0.32's ``validate_cache_salt``, a model validator that runs before the field
    checks and raises a ``VLLMValidationError``: a 400 ``BadRequestError`` with
    ``param: "cache_salt"``, not a pydantic validation error."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ApiError(
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
            param="cache_salt",
        )
    if len(salt) > CACHE_SALT_MAX_CHARS or not CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(
            f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_CHARS} characters and "
            "must not contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            param="cache_salt",
        )


def _validate(chat: bool, body: Mapping[str, Any]) -> None:
    """The checks vLLM's request model makes before any handler code: the ``cache_salt``
    validator first, then the fields' types (Bad Request)."""
    _check_cache_salt(body.get("cache_salt"))
    errors = _message_errors(body) if chat else []
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (error := _int_error(value, name)) is not None:
            errors.append(error)
    if errors:
        raise validation_error(errors)


def header_priority(headers: Mapping[str, str]) -> int | None:
    """The ``X-Vllm-Priority`` header as an int; a value that is not an integer is ignored."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def _json_invalid(position: int, error: str) -> ApiError:
    return validation_error(
        [
            {
                "type": "json_invalid",
                "loc": f"body.{position}",
                "msg": "JSON decode error",
                "input": "<dict of 0 items>",
                "ctx": {"error": error},
            }
        ]
    )


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON body, or vLLM's validation error for an empty, broken or non-object body."""
    if not raw.strip():
        raise validation_error(
            [{"type": "missing", "loc": "body", "msg": "Field required", "input": "None"}]
        )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _json_invalid(exc.pos, exc.msg) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _json_invalid(0, str(exc)) from None
    if not isinstance(body, dict):
        raise validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": "body",
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": _input_repr(body),
                }
            ]
        )
    return body


# --------------------------------------------------------------------------- the request


def natural_output_len(prompt_token_ids: list[int], seed: int) -> int:
    """A seeded 'where EOS would come' length: same prompt and seed, same length."""
    digest = zlib.crc32(array("I", prompt_token_ids).tobytes())
    rng = random.Random(seed * 0x9E3779B1 + digest)
    return max(1, round(rng.lognormvariate(0.0, NATURAL_LEN_SIGMA) * NATURAL_LEN_MEDIAN))


def unknown_model(model: Any, served_models: tuple[str, ...]) -> ApiError:
    """vLLM 0.32's 404 for a model it does not serve: the aliases are the served names only,
    never the LoRA adapters."""
    return ApiError(
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served_models)}.",
        404,
        "NotFoundError",
        "model",
    )


def served_model(
    body: Mapping[str, Any], served_models: tuple[str, ...], adapters: Container[str] = ()
) -> tuple[str, str | None]:
    """The model a request is answered as, and the LoRA adapter it names (or None).

    vLLM's ``_check_model``: no model (or an empty one) is the first served name, then a
    served name, then a loaded adapter; anything else is the 404."""
    model = body.get("model")
    if not model:
        return served_models[0], None
    if model in served_models:
        return str(model), None
    if isinstance(model, str) and model in adapters:
        return model, model
    raise unknown_model(model, served_models)


def _model_ids(tokenizer: PromptTokenizer, body: Mapping[str, Any]) -> list[int]:
    """The model tokenizer's ids for a chat, or a completion's one text prompt; its chat
    template's own errors (``raise_exception``, a content it cannot render) are 400s, as
    vLLM answers them."""
    from jinja2.exceptions import TemplateError  # the tokenizer's dependency, as it compiles

    try:
        ids = tokenizer.body_ids(body)
    except (TemplateError, TypeError, ValueError) as exc:
        raise ApiError(str(exc)) from None
    if ids is None:  # only a chat can get here: a tokenizer without a chat template
        raise ApiError(
            "As of transformers v4.44, default chat template is no longer allowed, so you "
            "must provide a chat template if the tokenizer does not define one."
        )
    return ids


def prompt_ids(
    chat: bool, body: Mapping[str, Any], tokenizer: PromptTokenizer | None = None
) -> list[int]:
    """The prompt's token ids: the rendered chat, or a completion's one prompt (token ids
    as given). Without a ``tokenizer``, ``extproc.core.prompt``'s: ``render_chat`` then
    ``tokenize``, ignoring ``add_generation_prompt``/``add_special_tokens``."""
    if chat:
        if body["messages"] is None:  # passes vLLM's validation, fails in its handler
            raise ApiError("'NoneType' object is not iterable")
        if tokenizer is not None:
            return _model_ids(tokenizer, body)
        return tokenize(render_chat(body["messages"]))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if tokenizer is not None:
            # Only what a completion's tokenizing reads (a stray "messages" is not a chat).
            options = {k: body[k] for k in ("add_special_tokens",) if k in body}
            return _model_ids(tokenizer, {"prompt": prompt, **options})
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt:
        raise ApiError(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            param="prompt",
        )
    raise ApiError("prompt: only one string or one list of token ids is supported", param="prompt")


def _requested_max_tokens(chat: bool, body: Mapping[str, Any]) -> int | None:
    """``max_completion_tokens`` (chat) or ``max_tokens``, as sent; completions default."""
    max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None and not chat:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    return max_tokens


def _effective_max_tokens(max_tokens: int | None, token_num: int, max_model_len: int) -> int:
    """The serving code's length checks; what is left for the output."""
    if token_num >= max_model_len:
        # vLLM tokenizes with truncation at max_model_len + 1, hence "at least".
        shown = min(token_num, max_model_len + 1)
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {shown} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={shown})",
            param="input_tokens",
        )
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(
            f"max_tokens must be at least 1, got {max_tokens}. "
            f"(parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    # vLLM 0.32 clamps a max_tokens that does not fit beside the prompt (no error).
    room = max_model_len - token_num
    return room if max_tokens is None else min(max_tokens, room)


def _output_len(
    body: Mapping[str, Any], token_ids: list[int], effective_max: int, seed: int
) -> int:
    """How many tokens the answer will have: all it may with ``ignore_eos``, else where
    the seeded EOS falls, never below ``min_tokens``."""
    min_tokens = _opt_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > effective_max:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={effective_max}, "
            f"got {min_tokens}."
        )
    if body.get("ignore_eos"):
        return effective_max
    natural = natural_output_len(token_ids, seed)
    return max(min_tokens, min(natural, effective_max))


def parse_generate(
    chat: bool,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    served_models: tuple[str, ...],
    max_model_len: int,
    seed: int,
    tokenizer: PromptTokenizer | None = None,
    adapters: Container[str] = (),
) -> GenerateRequest:
    """Validate a request body as vLLM would; raise ``ApiError`` (400/404) otherwise. The
    prompt is tokenized by ``tokenizer`` (the model's) when given, else by
    ``extproc.core.prompt``; ``adapters`` are the LoRA adapter names ``model`` may take."""
    _validate(chat, body)
    model, lora_name = served_model(body, served_models, adapters)
    prompt_token_ids = prompt_ids(chat, body, tokenizer)
    body_priority = _opt_int(body, "priority")
    hdr_priority = header_priority(headers)
    priority = hdr_priority if hdr_priority is not None else (body_priority or 0)
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise ApiError("The simulator supports only n=1.", param="n")
    params_max_tokens = _requested_max_tokens(chat, body)
    effective_max = _effective_max_tokens(params_max_tokens, len(prompt_token_ids), max_model_len)
    output_len = _output_len(body, prompt_token_ids, effective_max, seed)
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    base_id = headers.get("x-request-id") or uuid.uuid4().hex[:16]  # vLLM: 16 hex digits
    return GenerateRequest(
        chat=chat,
        model=model,
        request_id=("chatcmpl-" if chat else "cmpl-") + base_id,
        prompt_token_ids=prompt_token_ids,
        max_tokens=effective_max,
        params_max_tokens=params_max_tokens,
        output_len=output_len,
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        body_priority=body_priority,
        header_priority=hdr_priority,
        cache_salt=body.get("cache_salt"),
        lora_name=lora_name,
    )
