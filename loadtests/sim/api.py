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

from extproc.prompt import render_chat, tokenize

PRIORITY_HEADER = "x-vllm-priority"

# Filler output: words of at most 5 letters after a space, so each is exactly one token for
# extproc.prompt.count_tokens and the text of N tokens counts as N tokens again.
WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " sed", " do", " magna",
         " ut", " enim", " ad", " minim", " quis", " nisi", " aute", " irure")
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
    """An error answered in vLLM's ``ErrorResponse`` shape."""

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
        error = {"message": self.message, "type": self.err_type, "param": self.param,
                 "code": self.status}
        return dumps({"error": error})


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


def _as_int(value: Any, name: str) -> int:
    """Pydantic-lax int: ints, integral floats and integer strings; never bools."""
    if isinstance(value, bool):
        raise ApiError(f"{name}: Input should be a valid integer", param=name)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ApiError(f"{name}: Input should be a valid integer", param=name)


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    return None if value is None else _as_int(value, name)


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
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("Input should be a valid dictionary or object to extract fields from")
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
    model = body.get("model")
    if model is None:
        model = served_models[0]  # vLLM falls back to the first served name
    if model not in served_models:
        raise ApiError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError("messages: Field required" if messages is None
                           else "messages: Input should be a valid list", param="messages")
        prompt_ids = tokenize(render_chat(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenize(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        elif prompt is None:
            raise ApiError("prompt: Field required", param="prompt")
        else:
            raise ApiError("prompt: only one string or one list of token ids is supported",
                           param="prompt")

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
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    token_num = len(prompt_ids)
    if token_num >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {token_num} input tokens. Please reduce the length of the input "
            "messages.", param="input_tokens")
    if max_tokens is not None and token_num + max_tokens > max_model_len:
        raise ApiError(
            "'max_tokens' or 'max_completion_tokens' is too large: "
            f"{max_tokens}. This model's maximum context length is {max_model_len} tokens "
            f"and your request has {token_num} input tokens ({max_tokens} > {max_model_len}"
            f" - {token_num}).", param="max_tokens")
    effective_max = max_tokens if max_tokens is not None else max_model_len - token_num

    min_tokens = _opt_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                       param="min_tokens")
    if min_tokens > effective_max:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={effective_max}, "
            f"got {min_tokens}.", param="min_tokens")

    if body.get("ignore_eos"):
        output_len = effective_max
    else:
        natural = natural_output_len(prompt_ids, seed)
        output_len = max(min_tokens, min(natural, effective_max))

    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    base_id = headers.get("x-request-id") or uuid.uuid4().hex
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def full_response(
    req: GenerateRequest, num_output: int, finish_reason: str, created: int
) -> dict[str, Any]:
    """The non-streaming body of a finished request."""
    text = output_text(num_output)
    if req.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "tool_calls": [], "reasoning": None},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
        }
        return {"id": req.request_id, "object": "chat.completion", "created": created,
                "model": req.model, "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": usage(req.prompt_len, num_output),
                "prompt_logprobs": None, "prompt_token_ids": None,
                "kv_transfer_params": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
              "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
              "prompt_token_ids": None}
    return {"id": req.request_id, "object": "text_completion", "created": created,
            "model": req.model, "choices": [choice], "service_tier": None,
            "system_fingerprint": None, "usage": usage(req.prompt_len, num_output),
            "kv_transfer_params": None}


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChunkTemplates:
    """Pre-encoded SSE events of one streaming request (token text is the only variable)."""

    def __init__(self, req: GenerateRequest, created: int | None = None) -> None:
        self.req = req
        created = int(time.time()) if created is None else created
        head = {"id": req.request_id,
                "object": "chat.completion.chunk" if req.chat else "text_completion",
                "created": created, "model": req.model}
        self._head = head
        head_json = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        if req.chat:
            self.prefix = (head_json + ',"choices":[{"index":0,"delta":{"content":"').encode()
            self.suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self.prefix = (head_json + ',"choices":[{"index":0,"text":"').encode()
            self.suffix = (
                b'","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
            )
        self.prefix = b"data: " + self.prefix

    def first(self) -> bytes:
        """The chat role chunk vLLM sends before any token (nothing for completions)."""
        if not self.req.chat:
            return b""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return sse({**self._head, "choices": [choice]})

    def token(self, index: int) -> bytes:
        """The event carrying output token number ``index`` (0-based)."""
        return self.prefix + WORD_BYTES[index % len(WORD_BYTES)] + self.suffix

    def last(self, index: int, finish_reason: str) -> bytes:
        """The final token's event with its finish reason, the usage event, ``[DONE]``."""
        word = WORDS[index % len(WORDS)]
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": word},
                                      "logprobs": None, "finish_reason": finish_reason,
                                      "stop_reason": None}
        else:
            choice = {"index": 0, "text": word, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None}
        events = [sse({**self._head, "choices": [choice]}
                      | ({} if self.req.chat else {"usage": None}))]
        if self.req.include_usage:
            events.append(sse({**self._head, "choices": [],
                               "usage": usage(self.req.prompt_len, index + 1)}))
        events.append(SSE_DONE)
        return b"".join(events)


def models_body(served_models: tuple[str, ...], root: str, max_model_len: int) -> bytes:
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
         "parent": None, "max_model_len": max_model_len,
         "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                         "created": created, "allow_create_engine": False,
                         "allow_sampling": True, "allow_logprobs": True,
                         "allow_search_indices": False, "allow_view": True,
                         "allow_fine_tuning": False, "organization": "*", "group": None,
                         "is_blocking": False}]}
        for name in served_models
    ]
    return dumps({"object": "list", "data": data})
