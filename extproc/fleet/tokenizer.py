"""The served model's own tokenizer and chat template, so the gateway sees the engine's tokens.

Precise prefix routing compares a request's block hashes with the blocks an engine holds
(``extproc.fleet.kv_events``); the hashes are over token ids, so the gateway must produce the
ids the engine will: the same ``tokenizer.json`` (HF ``tokenizers``), the same chat template
(Jinja in a sandbox, as transformers renders it), and vLLM's choices around them (a chat is
encoded without the tokenizer's special tokens, since the template writes them; a completion
with them). Tokenizing is the expensive part (milliseconds for a long prompt:
docs/benchmarks/internals.md), so it is done lazily, a piece at a time
(``extproc.fleet.pieces``): each piece is tokenized only when the picker reads that far and
then cached, so a conversation re-sent with one more turn, or a shared system prompt, costs
only its new text. Pieces are used only when they give the whole text's ids for this
tokenizer, which is checked when it is loaded (``EngineTokenizer.from_dir``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from extproc.fleet.pieces import (
    COLD_CHARS,
    ColdBudget,
    PieceCache,
    ReadLater,
    TokenPieces,
    text_pieces,
)

log = logging.getLogger("fairlane.tokenizer")

MAX_PROMPT_CHARS = 32 * 1024
"""Longer prompts are cut before tokenizing: only their head decides prefix affinity, and
the work a prompt can cause stays bounded (here about 8-12k tokens, 11-20 ms of CPU to
read all of it uncached, which one request never does: ``COLD_CHARS``; the read-later
loop does, a piece at a time between requests; ``loadtests/bench/tokenize_cost.py``).
Blocks past the cut are not matched; the cut may change the last few tokens before it, so
the block holding it may not match either."""


class TokenizerError(ValueError):
    """The model directory cannot give the engine's tokenizer (missing or broken files)."""


class EngineTokenizer:
    """Token ids for a request body, as the engine serving the model would compute them.

    vLLM's choices around the tokenizer: chat completions render the template with
    ``add_generation_prompt`` (default true), then encode *without* the tokenizer's special
    tokens (vLLM's ``add_special_tokens`` default for chat: the template writes them);
    completions encode the prompt *with* them (vLLM's default there).

    Pieces: text between two special tokens (``tokenizers`` splits added tokens out first) is
    cut into pieces where a word starts. They are used only when they give the whole text's ids
    for this tokenizer (no added token strips the whitespace around it, and a probe text cut
    into pieces tokenizes as it does whole).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special: Mapping[str, str],
        source: str = "",
        max_chars: int | None = MAX_PROMPT_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.source = source
        self.max_chars = max_chars
        """Text past this many characters is cut before tokenizing (None: never): the
        gateway's bound on a request's cost; an engine (``fairlane sim``) counts it all."""
        self._template = _compile(chat_template) if chat_template else None
        self._special = dict(special)
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        cacheable = all(
            not (token.lstrip or token.rstrip or token.single_word) for token in added.values()
        )
        self._whole = not (cacheable and _cuts_cleanly(tokenizer, next(iter(self._added_ids), "")))
        """Only the whole text gives the engine's ids: added tokens eat the whitespace around
        them, or text cut where ``text_pieces`` cuts it tokenizes differently (a normalizer
        that prepends to every input does that, as older SentencePiece conversions have)."""
        self._splitter = (
            re.compile(
                "|".join(re.escape(t) for t in sorted(self._added_ids, key=len, reverse=True))
            )
            if self._added_ids
            else None
        )
        self._special_prefix = _special_prefix(tokenizer)
        self.cache = PieceCache()
        self.later = ReadLater()

    @classmethod
    def from_dir(
        cls, path: str | Path, max_chars: int | None = MAX_PROMPT_CHARS
    ) -> EngineTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a model directory."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: no such file (a model directory holds it)")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tokenizer_file}: {exc}") from None
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_file}: {exc}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: vLLM uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        special = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(name) is not None
        }
        return cls(
            tokenizer,
            template if isinstance(template, str) else None,
            special,
            str(directory),
            max_chars,
        )

    def body_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids for a chat (``messages``) or completion (``prompt``) body;
        None when the body has no single text prompt (token ids, several prompts, a chat
        without a template)."""
        pieces = self.body_pieces(body, cold_chars=None)
        return None if pieces is None else [i for ids, _ in pieces.pieces for i in ids]

    def body_pieces(
        self, body: Mapping[str, Any], cold_chars: int | None = COLD_CHARS
    ) -> TokenPieces | None:
        """``body_ids`` a piece at a time, each tokenized only when it is read; None as
        there. The chat template is rendered at once (the pieces are of its text)."""
        messages = body.get("messages")
        if isinstance(messages, list):
            if self._template is None:
                return None
            text = self.render_chat(messages, bool(body.get("add_generation_prompt", True)))
            special = bool(body.get("add_special_tokens", False))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            text, special = prompt, bool(body.get("add_special_tokens", True))
        if self.max_chars is not None:
            text = text[: self.max_chars]
        budget = ColdBudget(cold_chars) if cold_chars is not None else None
        reader = partial(self._pieces, text, special)
        pieces = self.later.reading((text, special), reader, budget, len(text))
        return TokenPieces(pieces, len(text))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template over ``messages``, content parts joined as vLLM joins them."""
        if self._template is None:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template")
        conversation = [
            {**message, "content": _content(message.get("content"))}
            for message in messages
            if isinstance(message, Mapping)
        ]
        return self._template.render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **self._special
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.max_chars is not None:
            text = text[: self.max_chars]
        return [i for ids, _ in self._pieces(text, add_special_tokens) for i in ids]

    def _pieces(
        self, text: str, add_special_tokens: bool, budget: ColdBudget | None = None
    ) -> Iterator[tuple[Sequence[int], int]]:
        """The ids of ``text`` in order, a piece at a time: the special tokens the
        tokenizer puts in front, then each added token on its own and the text between them
        in pieces (``text_pieces``), each looked up in or added to the cache, ending early
        once ``budget`` is spent; the whole text at once where this tokenizer does not
        allow pieces (see ``__init__``)."""
        if self._whole or (add_special_tokens and self._special_prefix is None):
            yield self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, len(text)
            return
        if add_special_tokens and self._special_prefix:
            yield self._special_prefix, 0
        start = 0
        if self._splitter is not None:
            for match in self._splitter.finditer(text):
                yield from self.cache.pieces(text, self._encode_piece, budget, start, match.start())
                if budget is not None and budget.stopped:
                    return
                yield (self._added_ids[match.group()],), match.end() - match.start()
                start = match.end()
        yield from self.cache.pieces(text, self._encode_piece, budget, start)

    def _encode_piece(self, text: str) -> list[int]:
        # The batch call without offsets: about 30 % less CPU than ``encode`` here.
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids


_PROBE = (
    "Hello world! It's 2024-06-01; the price is $1,234.56 (about 7 %).  Two  spaces,\ttabs, "
    "new\nlines\n\n and  café, naïve, 你好 — done. Don't you'll we've; x=y+z*2 /path/to?a=b "
    "CamelCase snake_case ALLCAPS 12345678 ...!? 'quoted' \"double\" <tag> {json: [1, 2]}"
)


def _cuts_cleanly(tokenizer: Tokenizer, added: str) -> bool:
    """Whether text cut at an added token and everywhere ``text_pieces`` may cut it
    tokenizes, piece by piece, to the ids of the whole: true of byte-level BPE and metaspace
    pre-tokenizers, false of a normalizer that prepends to every input."""
    text = f"{_PROBE}{added}{_PROBE}"
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    cut: list[int] = []
    for part in (_PROBE, added, _PROBE):
        for a, b in text_pieces(part, size=1):
            cut.extend(tokenizer.encode(part[a:b], add_special_tokens=False).ids)
    if cut != whole:
        log.info("this tokenizer changes ids where text is cut: prompts are tokenized whole")
    return cut == whole


def _special_prefix(tokenizer: Tokenizer) -> tuple[int, ...] | None:
    """The ids the tokenizer's post-processor puts in front of every text (a BOS), when
    that is all it adds; None when it adds more (an EOS after the text, say)."""
    front = list(tokenizer.encode("", add_special_tokens=True).ids)
    plain = list(tokenizer.encode(_PROBE, add_special_tokens=False).ids)
    with_special = list(tokenizer.encode(_PROBE, add_special_tokens=True).ids)
    return tuple(front) if with_special == front + plain else None


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def _content(content: Any) -> Any:
    """vLLM's "string" content format: text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type", "text") == "text"
        )
    return content


def _compile(source: str) -> Any:
    """The template compiled as transformers compiles chat templates (a sandbox, trimmed
    blocks, ``raise_exception`` and ``tojson``)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(source)
