"""The repository speaks of the product, not of how it was built.

No tracked text file names a work session or sitting, or an issue by number: a comment, a
docstring, a scenario or a page says what the gateway does and why. In Python only comments and
strings are prose (``session`` as a variable name is code). ``ALLOWED`` lists the few phrases
that are the product's own words (an HTTP or process session) or cite another project's issue
with its repository; this file, which has to name the words, is the one file not read.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve()

WORDS = re.compile(r"\bsessions?\b|\bsittings?\b|\bissues?[ -]?#?[0-9]+|\(#[0-9]+\)", re.IGNORECASE)

# Blanked out of a line before WORDS is searched in it.
ALLOWED = [
    # sessions of the product and of the machine, named as such
    re.compile(r"\b(aiohttp|HTTP|TLS|process|Unix) sessions?\b", re.IGNORECASE),
    # pytest's fixture scope, ``scope="session"``
    re.compile(r"""(["'])session\1"""),
    # another project's issue, cited with its repository: "vLLM #40004", "vllm-project/vllm#1"
    re.compile(r"\b(vLLM|[\w.-]+/[\w.-]+)( issue)? ?#[0-9]+"),
]


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    files = []
    for name in filter(None, names):
        path = REPO / name.decode()
        if not path.is_file() or path == THIS_FILE:  # deleted, not yet committed; or this file
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode()
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of prose in ``path``: every line, or in Python the
    comments and strings."""
    text = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), start=1)
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def offending(line: str) -> list[str]:
    for allowed in ALLOWED:
        line = allowed.sub(lambda m: " " * len(m.group()), line)
    return [m.group() for m in WORDS.finditer(line)]


def joined(previous: str, line: str) -> str:
    """Where a line break falls between the words: the last word of ``previous`` and the
    first of ``line`` (comment and list marks dropped), so "issue" at the end of one line
    and its number on the next are read together."""
    tail = previous.split()[-1:] if previous.strip() else []
    head = line.lstrip(" \t#>*-").split()[:1]
    return " ".join(tail + head)


def test_no_tracked_file_speaks_of_how_it_was_built() -> None:
    found = []
    for path in tracked_text_files():
        previous = ""
        for number, line in prose(path):
            words = offending(line) or offending(joined(previous, line))
            if words:
                found.append(f"{path.relative_to(REPO)}:{number}: {', '.join(words)}")
            previous = line
    assert not found, "words about how the repository was built:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "measured in the fourth session",
        "Sessions earlier had it",
        "in one sitting",
        "Issue 13: the hot path",
        "the cross-check of issue 16",
        "the README's issue-16 section",
        "see issue #7",
        "fixed (#12)",
    ],
)
def test_words_about_the_work_are_caught(line: str) -> None:
    assert offending(line)


def test_a_number_on_the_next_line_is_caught() -> None:
    assert offending(joined("an instant backend (issue", "  13, the hot path)"))
    assert offending(joined("# as issue", "# 7 said"))
    assert not offending(joined("an open issue", "with the engine"))


@pytest.mark.parametrize(
    "line",
    [
        "one aiohttp session for every scrape",
        "each child in a new process session (setsid)",
        '@pytest.fixture(scope="session")',
        "an engine full of batch waits (vLLM #40004)",
        "running one (vLLM issue #40004)",
        "envoyproxy/envoy#12345 explains it",
    ],
)
def test_the_products_own_words_pass(line: str) -> None:
    assert not offending(line)
