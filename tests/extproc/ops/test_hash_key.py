"""``fairlane hash-key``: the ``sha256:`` entry of a key, from the argument or from stdin."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.ops.cli import main
from extproc.policy import parse_policy

FAIRLANE = Path(sys.executable).with_name("fairlane")
DIGEST = hashlib.sha256(b"sk-chat-demo").hexdigest()


def test_prints_the_sha256_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash-key", "sk-chat-demo"]) == 0
    assert capsys.readouterr().out == f"sha256:{DIGEST}\n"


@pytest.mark.parametrize("argv", [["hash-key", "-"], ["hash-key"]])
def test_reads_the_key_from_stdin_without_its_newline(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("sk-chat-demo\n"))
    assert main(argv) == 0
    assert capsys.readouterr().out == f"sha256:{DIGEST}\n"


@pytest.mark.parametrize(("stdin", "problem"), [("\n", "empty"), ("sk a\n", "whitespace")])
def test_a_key_no_client_could_present_is_refused(
    stdin: str, problem: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(["hash-key", "-"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and problem in err


def test_the_printed_entry_authenticates_the_key_in_a_policy() -> None:
    """The installed command, fed on stdin, as an operator runs it."""
    result = subprocess.run(
        [str(FAIRLANE), "hash-key", "-"],
        input="sk-rotated-0001\n",
        capture_output=True,
        text=True,
        check=True,
    )
    entry = result.stdout.strip()
    policy = parse_policy(
        "tiers: [{name: a, priority: 0, queue_limit: 1, queue_deadline_s: 1}]\n"
        f"tenants: [{{name: t, api_keys: ['{entry}'], tiers: [a]}}]\n"
    )
    assert policy.warnings == ()
    found = policy.tenant_for_key("sk-rotated-0001")
    assert found is not None and found.name == "t"
