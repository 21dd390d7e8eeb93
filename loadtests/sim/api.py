"""The OpenAI-compatible surface as vLLM 0.32 shapes it: parsing, errors, response bodies.

Plain functions over dicts and bytes, no aiohttp, so the shapes can be tested and compared
with the real server without a socket. Field names and order follow vLLM's pydantic models
(``ChatCompletionStreamResponse`` dumped with ``exclude_unset=True`` for chat chunks,
``ErrorResponse`` with an integer ``code``).

Streaming is the hot path of the whole simulator (one SSE event per token per request), so
a request's token events are byte templates: a per-request prefix, the token's text (one
of a few pre-encoded filler words), and a constant suffix, with no ``json.dumps`` per token.
"""

from __future__ import annotations

import json
import random
import time
import uuid
import zlib
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.core.prompt import render_chat, tokenize

PRIORITY_HEADER = "x-vllm-priority"

# Filler output: words of at most 5 letters after a space, so each is exactly one token for
# extproc.core.prompt.count_tokens and the text of N tokens counts as N tokens again.
WORDS = (
    " lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    " sed",
    " do",
    " magna",
    " ut",
    " enim",
    " ad",
    " minim",
    " quis",
    " nisi",
    " aute",
    " irure",
)
WORD_BYTES = tuple(w.encode() for w in WORDS)

# The median and spread of simulated natural answer lengths (tokens) when no max_tokens
# stops the answer first: a log-normal, roughly matching chat-style outputs (ShareGPT's
# median output is about 200 tokens).
NATURAL_LEN_MEDIAN = 200
NATURAL_LEN_SIGMA = 0.9


def dumps(obj: Any) -> bytes:
    """Compact JSON, as Starlette's ``JSONResponse`` (vLLM's server) writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


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

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": self.err_type,
            "param": self.param,
            "code": self.status,
        }
        return dumps({"error": error})


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


def output_text(num_tokens: int, start: int = 0) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(start, start + num_tokens))


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

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


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


def _validate(chat: bool, body: Mapping[str, Any]) -> None:
    """The type checks vLLM's request model makes before any handler code (Bad Request)."""
    errors: list[dict[str, Any]] = []
    if chat:
        messages = body.get("messages")
        if "messages" not in body:
            errors.append(
                {
                    "type": "missing",
                    "loc": "body.messages",
                    "msg": "Field required",
                    "input": _input_repr(dict(body)),
                }
            )
        elif messages is not None and not isinstance(messages, list):
            errors.append(
                _field_error("list_type", "messages", "Input should be a valid list", messages)
            )
        elif isinstance(messages, list):
            for i, message in enumerate(messages):
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
                        "msg": "Input should be a valid dictionary or object to "
                        "extract fields from",
                        "input": shown,
                    }
                )
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


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON body, or vLLM's validation error for an empty, broken or non-object body."""
    if not raw.strip():
        raise validation_error(
            [{"type": "missing", "loc": "body", "msg": "Field required", "input": "None"}]
        )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": f"body.{exc.pos}",
                    "msg": "JSON decode error",
                    "input": "<dict of 0 items>",
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": "body.0",
                    "msg": "JSON decode error",
                    "input": "<dict of 0 items>",
                    "ctx": {"error": str(exc)},
                }
            ]
        ) from None
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


def natural_output_len(prompt_token_ids: list[int], seed: int) -> int:
    """A seeded 'where EOS would come' length: same prompt and seed, same length."""
    digest = zlib.crc32(array("I", prompt_token_ids).tobytes())
    rng = random.Random(seed * 0x9E3779B1 + digest)
    return max(1, round(rng.lognormvariate(0.0, NATURAL_LEN_SIGMA) * NATURAL_LEN_MEDIAN))


def parse_generate(
    chat: bool,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    served_models: tuple[str, ...],
    max_model_len: int,
    seed: int,
) -> GenerateRequest:
    """Validate a request body as vLLM would; raise ``ApiError`` (400/404) otherwise."""
    _validate(chat, body)
    model = body.get("model")
    if model is None:
        model = served_models[0]  # vLLM falls back to the first served name
    if model not in served_models:
        raise ApiError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(served_models)}.",
            404,
            "NotFoundError",
            "model",
        )

    if chat:
        if body["messages"] is None:  # passes vLLM's validation, fails in its handler
            raise ApiError("'NoneType' object is not iterable")
        prompt_ids = tokenize(render_chat(body["messages"]))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt_ids = tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        elif not prompt:
            raise ApiError(
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                param="prompt",
            )
        else:
            raise ApiError(
                "prompt: only one string or one list of token ids is supported", param="prompt"
            )

    body_priority = _opt_int(body, "priority")
    hdr_priority = header_priority(headers)
    priority = hdr_priority if hdr_priority is not None else (body_priority or 0)

    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise ApiError("The simulator supports only n=1.", param="n")

    max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None and not chat:
        max_tokens = 16  # CompletionRequest.max_tokens defaults to 16 in vLLM
    params_max_tokens = max_tokens
    token_num = len(prompt_ids)
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
    effective_max = room if max_tokens is None else min(max_tokens, room)

    min_tokens = _opt_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > effective_max:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={effective_max}, "
            f"got {min_tokens}."
        )

    if body.get("ignore_eos"):
        output_len = effective_max
    else:
        natural = natural_output_len(prompt_ids, seed)
        output_len = max(min_tokens, min(natural, effective_max))

    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    base_id = headers.get("x-request-id") or uuid.uuid4().hex[:16]  # vLLM: 16 hex digits
    return GenerateRequest(
        chat=chat,
        model=str(model),
        request_id=("chatcmpl-" if chat else "cmpl-") + base_id,
        prompt_token_ids=prompt_ids,
        max_tokens=effective_max,
        params_max_tokens=params_max_tokens,
        output_len=output_len,
        stream=stream,
        include_usage=include_usage,
        priority=priority,
        body_priority=body_priority,
        header_priority=hdr_priority,
    )


VLLM_VERSION = "0.32.0"


def system_fingerprint(model: str) -> str:
    """vLLM's ``system_fingerprint``: ``vllm-<version>-<8 hex>``, fixed for one server."""
    return f"vllm-{VLLM_VERSION}-{zlib.crc32(model.encode()):08x}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage object of a stream's usage chunk."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def full_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int | None]:
    """The usage object of a non-streamed answer (with the two ``*_details``, null)."""
    return {
        **usage(prompt_tokens, completion_tokens),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def full_response(
    req: GenerateRequest,
    num_output: int,
    finish_reason: str,
    created: int,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a finished request, keys in vLLM 0.32's order.

    vLLM's chat message has no ``tool_calls`` key when there are none.
    """
    text = output_text(num_output)
    fingerprint = fingerprint or system_fingerprint(req.model)
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        return {
            "id": req.request_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": full_usage(req.prompt_len, num_output),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": full_usage(req.prompt_len, num_output),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChunkTemplates:
    """Pre-encoded SSE events of one streaming request (token text is the only variable).

    Shapes as vLLM 0.32 sends them: the chat role chunk carries top-level
    ``prompt_token_ids``/``prompt_text`` (null); every token chunk has ``choices[].token_ids``
    (completions also ``prompt_token_ids`` and ``stop_reason``), all null, and no ``usage``
    key; the finishing chunk adds ``stop_reason``; ``system_fingerprint`` comes once, on the
    usage chunk, or on the finishing chunk when there is no usage chunk.
    """

    def __init__(
        self, req: GenerateRequest, created: int | None = None, fingerprint: str | None = None
    ) -> None:
        self.req = req
        self.fingerprint = fingerprint or system_fingerprint(req.model)
        created = int(time.time()) if created is None else created
        head = {
            "id": req.request_id,
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created,
            "model": req.model,
        }
        self._head = head
        head_json = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        if req.chat:
            self.prefix = (head_json + ',"choices":[{"index":0,"delta":{"content":"').encode()
            self.suffix = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        else:
            self.prefix = (head_json + ',"choices":[{"index":0,"text":"').encode()
            self.suffix = (
                b'","logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )
        self.prefix = b"data: " + self.prefix

    def first(self) -> bytes:
        """The chat role chunk vLLM sends before any token (nothing for completions)."""
        if not self.req.chat:
            return b""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse(
            {**self._head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None}
        )

    def token(self, index: int) -> bytes:
        """The event carrying output token number ``index`` (0-based)."""
        return self.prefix + WORD_BYTES[index % len(WORD_BYTES)] + self.suffix

    def last(self, index: int, finish_reason: str) -> bytes:
        """The final token's event with its finish reason, the usage event, ``[DONE]``."""
        word = WORDS[index % len(WORDS)]
        if self.req.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": word},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
        else:
            choice = {
                "index": 0,
                "text": word,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        last: dict[str, Any] = {**self._head, "choices": [choice]}
        if not self.req.include_usage:
            last["system_fingerprint"] = self.fingerprint
        events = [sse(last)]
        if self.req.include_usage:
            events.append(
                sse(
                    {
                        **self._head,
                        "choices": [],
                        "usage": usage(self.req.prompt_len, index + 1),
                        "system_fingerprint": self.fingerprint,
                    }
                )
            )
        events.append(SSE_DONE)
        return b"".join(events)


def models_body(served_models: tuple[str, ...], root: str, max_model_len: int) -> bytes:
    created = int(time.time())
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        for name in served_models
    ]
    return dumps({"object": "list", "data": data})
