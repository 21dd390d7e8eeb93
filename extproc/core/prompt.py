"""How text becomes tokens, shared by the gateway and the simulator.

The real tokenizer of a served model is not available to the gateway (and the simulator
has no model), so both use the same cheap, deterministic approximation: roughly one token
per short word piece, about 4 characters of English per token. Because both sides agree,
prefix-cache hashes the gateway computes match the blocks the simulator caches, and size
estimates used for fairness match what the simulator bills.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

VOCAB_SIZE = 32_000

# A piece is: an optional leading space plus up to 5 letters, or up to 3 digits, or one
# other visible character; runs of whitespace are one piece.
_PIECE = re.compile(r" ?[A-Za-z]{1,5}| ?\d{1,3}| ?[^\sA-Za-z\d]|\s+")


def pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def count_tokens(text: str) -> int:
    """Approximate token count of ``text`` (deterministic, ~4 characters per token)."""
    return len(_PIECE.findall(text))


def tokenize(text: str) -> list[int]:
    """Deterministic token ids for ``text`` (stable across processes and runs)."""
    return [zlib.crc32(p.encode()) % VOCAB_SIZE for p in _PIECE.findall(text)]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def render_chat(messages: Iterable[Mapping[str, Any]]) -> str:
    """Render chat messages as one prompt string, like a simple chat template would.

    The exact template does not matter; what matters is that it is a pure function of the
    messages, so that conversations sharing a prefix render to strings sharing a prefix.
    """
    parts = []
    for message in messages:
        role = str(message.get("role", "user"))
        parts.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


class BuiltinTokenizer:
    """This module's tokenizer as an engine's (``fairlane serve --tokenizer builtin``): the
    one fairlane's simulator tokenizes with, so precise prefix routing can be run against
    simulated engines whatever model name they serve."""

    source = "builtin"

    def body_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The token ids the simulator computes for a chat or completion body."""
        messages = body.get("messages")
        if isinstance(messages, list):
            return tokenize(render_chat(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return tokenize(prompt) if isinstance(prompt, str) else None
