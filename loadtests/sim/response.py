"""The bodies the simulator answers with, shaped as vLLM 0.32 shapes them.

Field names and order follow vLLM's pydantic models (``ChatCompletionStreamResponse``
dumped with ``exclude_unset=True`` for chat chunks, ``ErrorResponse`` with an integer
``code``), so a client (or the gateway) cannot tell the simulator from the real server by
its bytes. Plain functions, no aiohttp: the shapes are tested without a socket.

Streaming is the hot path of the whole simulator (one SSE event per token per request), so
a request's token events are byte templates: a per-request prefix, the token's text (one
of a few pre-encoded filler words), and a constant suffix, with no ``json.dumps`` per token.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.sim.request import ApiError, GenerateRequest

VLLM_VERSION = "0.32.0"

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


def dumps(obj: Any) -> bytes:
    """Compact JSON, as Starlette's ``JSONResponse`` (vLLM's server) writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def error_body(error: ApiError) -> bytes:
    """vLLM's ``ErrorResponse`` for ``error`` (its ``code`` is the HTTP status)."""
    body = {
        "message": error.message,
        "type": error.err_type,
        "param": error.param,
        "code": error.status,
    }
    return dumps({"error": body})


def output_text(num_tokens: int, start: int = 0) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(start, start + num_tokens))


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


def _chat_body(req: GenerateRequest, num_output: int, finish_reason: str) -> dict[str, Any]:
    """vLLM's chat message has no ``tool_calls`` key when there are none."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": output_text(num_output),
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
    return {"object": "chat.completion", "choices": [choice]}


def _completion_body(num_output: int, finish_reason: str) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": output_text(num_output),
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {"object": "text_completion", "choices": [choice]}


def full_response(
    req: GenerateRequest,
    num_output: int,
    finish_reason: str,
    created: int,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a finished request, keys in vLLM 0.32's order."""
    kind = (
        _chat_body(req, num_output, finish_reason)
        if req.chat
        else _completion_body(num_output, finish_reason)
    )
    body: dict[str, Any] = {
        "id": req.request_id,
        "object": kind["object"],
        "created": created,
        "model": req.model,
        "choices": kind["choices"],
        "service_tier": None,
        "system_fingerprint": fingerprint or system_fingerprint(req.model),
        "usage": full_usage(req.prompt_len, num_output),
    }
    if req.chat:
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


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


def _permission(created: int) -> dict[str, Any]:
    return {
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


def _card(
    name: str, root: str, parent: str | None, max_model_len: int | None, created: int
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission(created)],
    }


def models_body(
    served_models: tuple[str, ...],
    root: str,
    max_model_len: int,
    adapters: Sequence[tuple[str, str, str]] = (),
) -> bytes:
    """vLLM 0.32's ``/v1/models``: a card per served name (``root`` the model, no parent),
    then one per LoRA adapter, ``(id, path, parent)`` in load order, whose ``root`` is its
    path and which has no ``max_model_len`` (``show_available_models``)."""
    created = int(time.time())
    data = [_card(name, root, None, max_model_len, created) for name in served_models]
    data += [_card(name, path, parent, None, created) for name, path, parent in adapters]
    return dumps({"object": "list", "data": data})
