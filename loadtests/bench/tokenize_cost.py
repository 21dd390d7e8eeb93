"""What precise prefix routing costs the service per request: tokenizing and hashing.

``python -m loadtests.bench.tokenize_cost [--out FILE]`` measures, for chat prompts of about
2k, 8k and 32k tokens, the CPU time of what the picker needs before it can match a prompt
against an engine's KV events: the engine's chat template and tokenizer
(``extproc.fleet.tokenizer``) and vLLM's block hash chain (``extproc.core.blockhash``), at
block sizes 16 (vLLM's default on GPUs) and 128 (its CPU platform's), for a prompt never
seen, a conversation's next turn, and what one request pays when only part of a prompt is
read (``measure`` lists the cases). The tokenizer is the tiny model's
(``loadtests.conformance.tiny_model``); a production model's tokenizer has a larger
vocabulary and its own speed, so the figures are this machine's and this tokenizer's, in CPU
time of the one process (``time.process_time``), not wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from extproc.core.blockhash import BlockHasher
from extproc.core.prefix import EngineHashing, PromptBlocks
from extproc.fleet.tokenizer import EngineTokenizer
from loadtests.conformance.tiny_model import build_tokenizer, corpus

SIZES = (2_000, 8_000, 32_000)
BLOCK_SIZES = (16, 128)
ROUNDS = 20


def text_of(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """Pseudo-English text of about ``tokens`` tokens for ``tokenizer``."""
    text = " ".join(corpus(seed, lines=max(50, tokens // 4)))
    while len(tokenizer.encode(text).ids) < tokens:
        text += " " + text
    return text[: int(len(text) * tokens / len(tokenizer.encode(text).ids))]


def cpu_us(work: Callable[[Any], Any], inputs: list[Any]) -> float:
    """Mean CPU microseconds of ``work`` over ``inputs`` (made beforehand, not timed)."""
    start = time.process_time()
    for item in inputs:
        work(item)
    return (time.process_time() - start) / len(inputs) * 1e6


def measure(
    tokenizer: EngineTokenizer, plain: Tokenizer, tokens: int, rounds: int = ROUNDS
) -> dict[str, Any]:
    """The CPU time of each case at ``tokens`` tokens, at both block sizes.

    The cases: ``cold``, a system prompt never seen before (every piece tokenized); ``warm``,
    the same system prompt and earlier turns with a new user message (the segment cache serves
    all but the new text), what a multi-turn chat costs; ``unheld``, what the picker itself pays
    for a prompt never seen that no engine holds (``PromptBlocks.keys`` read until the first
    block an engine lacks: the template, the first piece, one block's hash), per block size;
    ``held, new``, what one request pays for a prompt an engine holds in full that this process
    never read (another replica sent it): as far as its budget of new text goes
    (``extproc.fleet.pieces.COLD_CHARS``), the rest left to the requests after it (``cold`` is
    all of such a prompt read at once). Prompts longer than ``MAX_PROMPT_CHARS`` are cut before
    tokenizing (``tokenized`` says how many tokens were kept).
    """
    hasher = BlockHasher()
    system = text_of(plain, tokens, seed=tokens)
    words = " ".join(corpus(1, 20)).split()
    rng = random.Random(tokens)
    # Cold prompts are texts of their own, not the same text shifted: pieces are cut where
    # a word starts some way on, so a shifted copy would meet the cache after one piece.
    fresh = [text_of(plain, tokens, seed=tokens * 1000 + n) for n in range(rounds)]

    def chat(n: int, prompt: str) -> dict[str, Any]:
        question = f"question {n}: " + " ".join(rng.choice(words) for _ in range(60))
        return {
            "messages": [
                {"role": "system", "content": prompt},
                {"role": "user", "content": question},
            ]
        }

    ids = tokenizer.body_ids(chat(0, system)) or []
    result: dict[str, Any] = {"prompt_tokens": len(plain.encode(system).ids), "tokenized": len(ids)}
    cold = [chat(n, fresh[n]) for n in range(rounds)]
    result["cold_tokenize_us"] = round(cpu_us(tokenizer.body_ids, cold))
    warm = [chat(n, system) for n in range(rounds)]
    result["warm_tokenize_us"] = round(cpu_us(tokenizer.body_ids, warm))
    for block_size in BLOCK_SIZES:
        # What the picker pays for a prompt never seen that no engine holds: the template,
        # the first piece, its first block's hash (``BlockKeys`` read until a miss).
        unseen = [chat(n, f"{block_size} {fresh[n]}") for n in range(rounds)]
        engine = EngineHashing(tokenizer, BlockHasher())
        result[f"unheld_{block_size}_us"] = round(
            cpu_us(lambda body: _first_miss(engine, body, block_size), unseen)  # noqa: B023
        )
        # An engine holds all of it, but this process never read it: one request reads
        # as far as its budget of new text (``COLD_CHARS``) goes.
        held = [chat(n, f"held {block_size} {fresh[n]}") for n in range(rounds)]
        engine = EngineHashing(tokenizer, BlockHasher())
        result[f"held_new_{block_size}_us"] = round(
            cpu_us(lambda body: _read_all(engine, body, block_size), held)  # noqa: B023
        )
    for block_size in BLOCK_SIZES:
        # cold: a hasher that has seen none of the blocks; warm: one that hashed them before
        # (a shared system prompt, a conversation's earlier turns).
        hashers = [BlockHasher() for _ in range(rounds)]
        result[f"hash_{block_size}_cold_us"] = round(
            cpu_us(lambda hasher: hasher.keys(ids, block_size), hashers)  # noqa: B023
        )
        hasher.keys(ids, block_size)
        result[f"hash_{block_size}_warm_us"] = round(
            cpu_us(lambda prompt: hasher.keys(prompt, block_size), [ids] * rounds)  # noqa: B023
        )
    return result


def _first_miss(engine: EngineHashing, body: dict[str, Any], block_size: int) -> None:
    keys = PromptBlocks("", "", body, engine).keys(block_size)
    assert keys is not None
    next(iter(keys), None)


def _read_all(engine: EngineHashing, body: dict[str, Any], block_size: int) -> None:
    keys = PromptBlocks("", "", body, engine).keys(block_size)
    assert keys is not None
    keys.all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        build_tokenizer(Path(directory))
        tokenizer = EngineTokenizer.from_dir(directory)
        plain = Tokenizer.from_file(f"{directory}/tokenizer.json")
        rows = [measure(tokenizer, plain, size, args.rounds) for size in SIZES]
    header = (
        f"{'prompt tokens':>14} {'tokenized':>14} {'cold tokenize':>14} {'warm tokenize':>14}"
        + "".join(f" {f'hash/{b} {kind}':>14}" for b in BLOCK_SIZES for kind in ("cold", "warm"))
        + "".join(f" {f'unheld/{b}':>14}" for b in BLOCK_SIZES)
        + "".join(f" {f'held, new/{b}':>14}" for b in BLOCK_SIZES)
    )
    print(header + "   (CPU us per request)")
    for row in rows:
        cells = [
            row[k] for k in ("prompt_tokens", "tokenized", "cold_tokenize_us", "warm_tokenize_us")
        ]
        hashes = "".join(
            f" {row[f'hash_{b}_{kind}_us']:>14}" for b in BLOCK_SIZES for kind in ("cold", "warm")
        )
        unheld = "".join(f" {row[f'unheld_{b}_us']:>14}" for b in BLOCK_SIZES)
        unheld += "".join(f" {row[f'held_new_{b}_us']:>14}" for b in BLOCK_SIZES)
        print("".join(f"{cell:>14} " for cell in cells).rstrip() + hashes + unheld)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
