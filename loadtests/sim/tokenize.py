"""vLLM's ``POST /tokenize``: a prompt's token ids as the engine would compute them.

Routers that place a request by what an engine has cached ask the engine itself for the
prompt's tokens: vllm-router's ``kv_aware`` policy posts the chat to a worker's
``/tokenize`` (after ``/v1/chat/completions/render``, which the simulator does not serve),
hashes the ids into blocks and looks them up in the index its KV events built. The ids must
be the ones the engine's own blocks and ``BlockStored.token_ids`` are made of, so this reads
the body exactly as a generate request is read (``request.prompt_ids``: the built-in
approximation, or ``--tokenizer DIR``'s tokenizer and chat template).

vLLM 0.32's shapes: a chat (``messages``) or a completion (``prompt``) body; the model
checked as for generation (404 for a name it does not serve); the answer ``{"count",
"max_model_len", "tokens", "token_strs"}``, ``token_strs`` null unless ``return_token_strs``
asks for it (then the built-in tokenizer's pieces; null with ``--tokenizer``).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from extproc.core.prompt import pieces, render_chat
from loadtests.sim.request import ApiError, PromptTokenizer, prompt_ids, served_model


def tokenize_answer(
    body: Mapping[str, Any],
    served_models: tuple[str, ...],
    max_model_len: int,
    tokenizer: PromptTokenizer | None = None,
    adapters: Container[str] = (),
) -> dict[str, Any]:
    """The ``/tokenize`` answer for ``body``; :class:`ApiError` as vLLM refuses it."""
    served_model(body, served_models, adapters)
    chat = "messages" in body
    if not chat and "prompt" not in body:
        raise ApiError("Field required: either messages or prompt", param="prompt")
    if chat and not isinstance(body["messages"], list):
        raise ApiError("messages: Input should be a valid list", param="messages")
    ids = prompt_ids(chat, body, tokenizer)
    token_strs = None
    if body.get("return_token_strs") and tokenizer is None:
        text = render_chat(body["messages"]) if chat else str(body.get("prompt"))
        token_strs = pieces(text)
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": token_strs,
    }
