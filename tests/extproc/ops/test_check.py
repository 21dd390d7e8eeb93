"""``fairlane check``: tables on success, file:line errors and exit 1 on failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.ops.cli import main
from extproc.policy import hashed_form

REPO = Path(__file__).resolve().parents[3]
FAIRLANE = Path(sys.executable).with_name("fairlane")


def test_default_policy_is_described(capsys: pytest.CaptureFixture[str]) -> None:
    default = REPO / "policies" / "default.yaml"
    assert main(["check", str(default)]) == 0
    out, err = capsys.readouterr()
    # the demo keys are plaintext: each is a warning at its line, and the check still passes
    assert [line.split(": warning: ")[0] for line in err.splitlines()] == [
        f"{default}:{line}: tenants[{i}].api_keys[0]" for i, line in enumerate((59, 62, 65))
    ]
    assert "OK, 3 tiers, 3 tenants" in out
    lines = out.splitlines()
    tiers_at = next(i for i, line in enumerate(lines) if line.startswith("TIER "))
    assert lines[tiers_at].split() == [
        "TIER",
        "RANK",
        "VLLM",
        "PRIORITY",
        "QUEUE",
        "LIMIT",
        "DEADLINE",
        "SLO",
        "ALIASES",
    ]
    assert lines[tiers_at + 1].split()[:6] == ["interactive", "0", "0", "256", "10s", "ttft"]
    assert lines[tiers_at + 3].split()[:5] == ["batch", "2", "20", "100000", "3600s"]
    chat = next(line for line in lines if line.startswith("chat-app "))
    assert chat.split() == [
        "chat-app",
        "interactive",
        "interactive",
        "1",
        "all",
        "-",
        "1",
        "(sk-c…)",
    ]
    assert "MODEL ALIAS" not in out  # no aliases, no table
    for key in ("sk-chat-demo", "sk-api-demo", "sk-batch-demo"):
        assert key not in out  # keys are secrets: only a prefix is shown
    assert "batch-endpoint" in out and "/v1/batch -> /v1" in out


def test_no_argument_checks_the_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check"]) == 0
    assert "nightly-batch" in capsys.readouterr().out


def test_example_policy_is_described(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(REPO / "policies" / "example.yaml")]) == 0
    out = capsys.readouterr().out
    assert "on_escalation reject" in out
    assert "2 (sk-s…, sk-s…)" in out  # two keys, shown as prefixes
    lines = out.splitlines()
    assert lines[0].endswith(": OK, 4 tiers, 3 tenants, 5 rules, 2 model aliases")
    tenants_at = next(i for i, line in enumerate(lines) if line.startswith("TENANT "))
    tenants = cells(lines[tenants_at : tenants_at + 4])
    assert [row[:1] + row[4:6] for row in tenants] == [
        ["TENANT", "MODELS", "DEFAULT MODEL"],
        ["support-chat", "llama-70b-*, chat-latest", "chat-latest"],
        ["internal-tools", "llama-8b, gpt-4o-mini, team-a/*", "gpt-4o-mini"],
        ["data-pipeline", "all", "-"],
    ]
    assert tenants[0] == [
        "TENANT",
        "TIERS",
        "DEFAULT TIER",
        "WEIGHT",
        "MODELS",
        "DEFAULT MODEL",
        "KEYS",
    ]
    aliases_at = next(i for i, line in enumerate(lines) if line.startswith("MODEL ALIAS "))
    assert [line.split() for line in lines[aliases_at : aliases_at + 4]] == [
        ["MODEL", "ALIAS", "SERVED", "MODEL", "WEIGHT", "SHARE"],
        ["gpt-4o-mini", "llama-8b", "1", "100%"],
        ["chat-latest", "llama-70b-v2", "90", "90%"],
        ["chat-latest", "llama-70b-v3", "10", "10%"],
    ]
    adapters_at = next(i for i, line in enumerate(lines) if line.startswith("RUNTIME ADAPTER "))
    assert [line.split() for line in lines[adapters_at : adapters_at + 2]] == [
        ["RUNTIME", "ADAPTER", "BASE", "LOADED", "FROM"],
        ["support-tone", "llama-8b", "/adapters/support-tone"],
    ]


def cells(lines: list[str]) -> list[list[str]]:
    """A printed table's cells, cut where its headings (which may hold a space) start."""
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", lines[0])]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [[line[a:b].strip() for a, b in bounds] for line in lines]


def test_alias_shares_are_of_the_alias_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "aliases.yaml"
    policy.write_text(
        "tiers:\n"
        "  - {name: a, priority: 0, queue_limit: 1, queue_deadline_s: 1}\n"
        "models:\n"
        "  aliases:\n"
        "    thirds: [{model: x, weight: 1}, {model: y, weight: 2}, {model: z, weight: 0.5}]\n"
        "tenants:\n"
        f"  - {{name: t, api_keys: [{hashed_form('sk-t-0001')}], tiers: [a], models: [x]}}\n"
    )
    assert main(["check", str(policy)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("thirds ")]
    assert rows == [
        ["thirds", "x", "1", "28.6%"],
        ["thirds", "y", "2", "57.1%"],
        ["thirds", "z", "0.5", "14.3%"],
    ]


def test_model_errors_go_to_stderr_with_their_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text(
        "tiers:\n"
        "  - {name: a, priority: 0, queue_limit: 1, queue_deadline_s: 1}\n"
        "models:\n"
        "  aliases:\n"
        "    fast: [{model: small, weight: 0}]\n"
        "tenants:\n"
        "  - name: t\n"
        f"    api_keys: [{hashed_form('sk-t-0001')}]\n"
        "    tiers: [a]\n"
        "    models: [big-*]\n"
        "    default_model: small\n"
    )
    assert main(["check", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{bad}:5: models.aliases.fast[0].weight: must be > 0, not 0",
        f"{bad}:11: tenants[0].default_model: 'small' is not allowed by this tenant's "
        "models (big-*)",
        f"{bad}: 2 errors",
    ]


def test_errors_go_to_stderr_with_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "tiers:\n"
        "  - {name: a, priority: 0, queue_limit: -1, queue_deadline_s: 1}\n"
        "tenants:\n"
        "  - {name: t, api_keys: [sk-t-0001], tiers: [b]}\n"
    )
    assert main(["check", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{bad}:2: tiers[0].queue_limit: must be >= 0, not -1",
        f"{bad}:4: tenants[0].tiers[0]: unknown tier 'b' (tiers are: a)",
        f"{bad}: 2 errors",
    ]


def test_yaml_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("tiers:\n  - name: a\n   priority: 0\n")
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:3: YAML syntax error")


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_the_installed_command() -> None:
    result = subprocess.run(
        [str(FAIRLANE), "check", "policies/default.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "policies/default.yaml: OK, 3 tiers, 3 tenants" in result.stdout
    assert "chat-app" in result.stdout


def test_plaintext_keys_are_warned_about_and_other_forms_are_shown_by_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAT_KEY", "sk-from-env-0001")
    (tmp_path / "api.key").write_text("sk-from-file-0001\n")
    policy = tmp_path / "keys.yaml"
    policy.write_text(
        "tiers:\n"
        "  - {name: a, priority: 0, queue_limit: 1, queue_deadline_s: 1}\n"
        "tenants:\n"
        "  - name: chat\n"
        "    api_keys: [env:CHAT_KEY, sk-plain-0001]\n"
        "    tiers: [a]\n"
        "  - name: api\n"
        f"    api_keys: [file:api.key, {hashed_form('sk-hashed-0001')}]\n"
        "    tiers: [a]\n"
    )
    assert main(["check", str(policy)]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"{policy}:5: tenants[0].api_keys[1]: warning: plaintext API key sk-p…: write it as "
        "sha256:HEX (`fairlane hash-key -` prints it), env:NAME or file:PATH to keep the "
        "secret out of the policy\n"
    )
    assert "2 (env:CHAT_KEY, sk-p…)" in out
    assert f"2 (file:api.key, {hashed_form('sk-hashed-0001')[:15]}…)" in out
    for secret in ("sk-from-env-0001", "sk-from-file-0001", "sk-plain-0001", "sk-hashed-0001"):
        assert secret not in out + err
