"""Micro-benchmarks of the service's per-request and per-scrape work, each against its budget.

``python -m loadtests.bench.micro`` times, in this process on this machine: a vLLM
``/metrics`` page read by ``parse_metrics`` (the poller's work ten times a second per
backend; budget 1 ms) against ``prometheus_client``'s parser; an API key's owner found among
1 and 100,000 keys (one hash and a dict hit: the big index within 3x the small one); a policy
of 20,000 tenants with a duplicate name refused by ``parse_policy`` (budget 4 s: checking
duplicates by scanning took 16 s); the fair scheduler's push and pop (or remove) with 10,000
entries queued over 1,000 flows; and an 8.8 KB prompt hashed in character chunks, as every
request is, against tokenizing it first. Unit tests check what these functions return; their
speed is measured here. Each line with a budget says ``met`` or ``NOT MET``, and the exit
status is 1 when one is missed. The figures recorded so far: docs/benchmarks/internals.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from extproc.core.prefix import CHARS_PER_TOKEN, prefix_blocks
from extproc.core.prompt import BuiltinTokenizer
from extproc.core.scheduler import BandConfig, Entry, FairnessConfig, FairScheduler
from extproc.fleet.prefix_cache import PrefixLRU
from extproc.fleet.vllm_metrics import parse_metrics
from extproc.policy import PolicyError, parse_policy
from extproc.policy.keys import KeyIndex, key_digest

REPO = Path(__file__).resolve().parents[2]
METRICS_PAGE = REPO / "tests" / "extproc" / "data" / "vllm-0.32-metrics.txt"
"""vLLM 0.32's own ``/metrics`` dump (52 KB, 634 lines), as the unit tests read it."""

POLICY_HEAD = """\
tiers:
  - name: slow
    priority: 20
    queue_limit: 100
    queue_deadline_s: 600
tenants:
"""


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    budget: float | None
    detail: str

    @property
    def met(self) -> bool:
        return self.budget is None or self.value <= self.budget

    def line(self) -> str:
        budget = "" if self.budget is None else f" (budget {self.budget:g} {self.unit})"
        verdict = "" if self.budget is None else ("  met" if self.met else "  NOT MET")
        return f"{self.name:<19} {self.value:10.3f} {self.unit}{budget}{verdict}  {self.detail}"


def best_s(work: Callable[[], object], number: int, repeat: int = 5) -> float:
    """Seconds per call of ``work``: the best of ``repeat`` rounds of ``number`` calls."""
    return min(timeit.repeat(work, number=number, repeat=repeat)) / number


def metrics_parse(page: str) -> list[Figure]:
    focused = best_s(lambda: parse_metrics(page, 0.0), number=200)
    generic = best_s(lambda: list(text_string_to_metric_families(page)), number=5, repeat=3)
    return [
        Figure("metrics-parse", focused * 1e6, "µs", 1000.0, f"{len(page):,} bytes a page"),
        Figure("metrics-generic", generic * 1e3, "ms", None, "prometheus_client, same page"),
    ]


def key_lookup() -> list[Figure]:
    small = KeyIndex([(key_digest("sk-0"), 0)])
    big = KeyIndex((key_digest(f"sk-{i}"), i) for i in range(100_000))
    small_s = best_s(lambda: small.find("sk-0"), number=2000)
    big_s = best_s(lambda: big.find("sk-99999"), number=2000)
    return [
        Figure("key-lookup", big_s * 1e9, "ns", None, "among 100,000 keys"),
        Figure("key-lookup-1", small_s * 1e9, "ns", None, "among 1 key"),
        Figure("key-lookup-x", big_s / small_s, "x", 3.0, "100,000 keys against 1"),
    ]


def tenants_parse(count: int = 20_000) -> list[Figure]:
    text = POLICY_HEAD + "".join(
        f"  - name: t{i}\n    api_keys: [sk-t{i}-key]\n    tiers: [slow]\n" for i in range(count)
    )
    text += "  - name: t7\n    api_keys: [sk-again]\n    tiers: [slow]\n"
    started = time.perf_counter()
    try:
        parse_policy(text, "p.yaml")
    except PolicyError as err:
        refused = "defined twice" in str(err)
    else:
        refused = False
    elapsed = time.perf_counter() - started
    if not refused:
        raise SystemExit("tenants-parse: the duplicate tenant was not reported")
    return [Figure("tenants-parse", elapsed, "s", 4.0, f"{count:,} tenants and a duplicate")]


def scheduler_ops(depth: int = 10_000, flows: int = 1_000, rounds: int = 50_000) -> list[Figure]:
    scheduler = FairScheduler(clock=lambda: 0.0)
    bands = [BandConfig(name, rank, 10**9) for rank, name in enumerate("abc")]
    scheduler.configure(bands, FairnessConfig())
    ids = itertools.count()

    def entry() -> Entry:
        i = next(ids)
        return Entry(f"r{i}", "abc"[i % 3], f"f{i % flows}", 1.0, 100, 50, 0.0)

    for _ in range(depth):
        scheduler.push(entry())
    made = [entry() for _ in range(rounds)]  # built beforehand: not timed
    started = time.perf_counter()
    for one in made:
        scheduler.push(one)
        scheduler.pop()
    push_pop = (time.perf_counter() - started) / rounds
    made = [entry() for _ in range(rounds)]
    started = time.perf_counter()
    for one in made:
        scheduler.push(one)
        scheduler.remove(one)
    push_remove = (time.perf_counter() - started) / rounds
    where = f"{depth:,} queued over {flows:,} flows"
    return [
        Figure("scheduler-pop", push_pop * 1e6, "µs", None, f"push + pop, {where}"),
        Figure("scheduler-rm", push_remove * 1e6, "µs", None, f"push + remove, {where}"),
    ]


def prefix_hashing(block_size: int = 16) -> list[Figure]:
    text = " ".join(f"word{i % 211} of the shared system prompt" for i in range(250))
    tokenizer = BuiltinTokenizer()
    body = {"prompt": text}
    ids = tokenizer.body_ids(body) or []
    chars = block_size * CHARS_PER_TOKEN
    hashes = prefix_blocks(text, chars)
    lru = PrefixLRU()
    lru.record(hashes)
    size = f"{len(text):,} chars, {len(ids):,} tokens"
    return [
        Figure(
            "prefix-chars",
            best_s(lambda: prefix_blocks(text, chars), 200) * 1e6,
            "µs",
            None,
            f"character chunks, {size}",
        ),
        Figure(
            "prefix-tokens",
            best_s(lambda: tokenizer.body_ids(body), 20) * 1e6,
            "µs",
            None,
            f"tokenizing, {size}",
        ),
        Figure(
            "prefix-token-chain",
            best_s(lambda: prefix_blocks(ids, block_size), 200) * 1e6,
            "µs",
            None,
            f"token blocks of {block_size}, once tokenized",
        ),
        Figure(
            "prefix-record",
            best_s(lambda: lru.record(hashes), 200) * 1e6,
            "µs",
            None,
            f"recording {len(hashes)} hashes in a backend's LRU",
        ),
        Figure(
            "prefix-match",
            best_s(lambda: lru.match(hashes), 200) * 1e6,
            "µs",
            None,
            f"matching {len(hashes)} hashes",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.micro", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--page", type=Path, default=METRICS_PAGE, help="a vLLM /metrics page")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = [
        *metrics_parse(args.page.read_text()),
        *key_lookup(),
        *tenants_parse(),
        *scheduler_ops(),
        *prefix_hashing(),
    ]
    for figure in figures:
        print(figure.line())
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2) + "\n")
    return 0 if all(f.met for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
