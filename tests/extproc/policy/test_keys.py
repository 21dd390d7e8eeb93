"""API keys in a policy: the four forms, their errors at file:line, lookup by digest, rotation."""

from __future__ import annotations

import hashlib
import os
import textwrap
from pathlib import Path

import pytest

from extproc.policy import (
    Policy,
    PolicyError,
    PolicyStore,
    Tenant,
    Tier,
    hashed_form,
    key_label,
    load_policy,
    parse_policy,
)
from extproc.policy import keys as keys_module
from extproc.policy.keys import KeyIndex, key_digest, self_contained_digest
from extproc.policy.parse import PLAINTEXT_WARNINGS_LISTED as PLAINTEXT

HEAD = """\
tiers:
  - name: fast
    priority: 0
    queue_limit: 10
    queue_deadline_s: 5
tenants:
"""


def tenant(name: str, *keys: str) -> str:
    listed = ", ".join(f'"{key}"' for key in keys)
    return f"  - name: {name}\n    api_keys: [{listed}]\n    tiers: [fast]\n"


def policy_of(*tenants: str, filename: str = "p.yaml", base_dir: Path | None = None) -> Policy:
    return parse_policy(HEAD + "".join(tenants), filename, base_dir)


def errors_of(*tenants: str, base_dir: Path | None = None) -> list[str]:
    with pytest.raises(PolicyError) as info:
        policy_of(*tenants, base_dir=base_dir)
    return info.value.errors


def test_hashed_form_is_sha256_hex_of_the_utf8_key() -> None:
    assert hashed_form("sk-ü") == "sha256:" + hashlib.sha256("sk-ü".encode()).hexdigest()


def test_each_form_authenticates_the_same_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_KEY", "sk-from-env")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "bob").write_text("sk-from-file\n")  # the newline is not the key's
    policy = policy_of(
        tenant("plain", "sk-plain-0001"),
        tenant("hashed", hashed_form("sk-hashed-0001").upper().replace("SHA256:", "sha256:")),
        tenant("env", "env:FAIRLANE_TEST_KEY"),
        tenant("file", "file:keys/bob"),
        base_dir=tmp_path,
    )
    for key, name in [
        ("sk-plain-0001", "plain"),
        ("sk-hashed-0001", "hashed"),
        ("sk-from-env", "env"),
        ("sk-from-file", "file"),
    ]:
        found = policy.tenant_for_key(key)
        assert found is not None and found.name == name, key
    for wrong in ("sk-from-file\n", "env:FAIRLANE_TEST_KEY", "file:keys/bob", "sk-plain-000"):
        assert policy.tenant_for_key(wrong) is None
    assert policy.tenant_for_key(hashed_form("sk-hashed-0001")) is None  # a digest is no key


def test_relative_key_files_are_read_from_the_policy_files_directory(tmp_path: Path) -> None:
    (tmp_path / "chat.key").write_text("sk-chat-file\r\n")
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + tenant("chat", "file:chat.key"))
    assert load_policy(path).tenant_for_key("sk-chat-file") is not None


def test_unusable_entries_are_errors_at_their_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAIRLANE_UNSET_KEY", raising=False)
    monkeypatch.setenv("FAIRLANE_EMPTY_KEY", "")
    monkeypatch.setenv("FAIRLANE_SPACED_KEY", "sk-LEAKCHECK has spaces")
    (tmp_path / "binary.key").write_bytes(b"\xff\xfe")
    errors = errors_of(
        tenant("a", "sha256:abc"),
        tenant("b", "sha256:" + "g" * 64),
        tenant("c", "env:FAIRLANE_UNSET_KEY"),
        tenant("d", "env:FAIRLANE_EMPTY_KEY"),
        tenant("e", "env:FAIRLANE_SPACED_KEY"),
        tenant("f", "file:missing.key"),
        tenant("g", "file:binary.key"),
        tenant("h", "env:"),
        tenant("i", "file:"),
        tenant("j", "sk with space"),
        base_dir=tmp_path,
    )
    assert errors == [
        "p.yaml:8: tenants[0].api_keys[0]: sha256: must be followed by 64 hex digits",
        "p.yaml:11: tenants[1].api_keys[0]: sha256: must be followed by 64 hex digits",
        "p.yaml:14: tenants[2].api_keys[0]: environment variable FAIRLANE_UNSET_KEY is not set",
        "p.yaml:17: tenants[3].api_keys[0]: the key in env:FAIRLANE_EMPTY_KEY is empty",
        "p.yaml:20: tenants[4].api_keys[0]: the key in env:FAIRLANE_SPACED_KEY contains whitespace",
        f"p.yaml:23: tenants[5].api_keys[0]: cannot read key file {tmp_path}/missing.key: "
        "No such file or directory",
        f"p.yaml:26: tenants[6].api_keys[0]: key file {tmp_path}/binary.key is not UTF-8 text",
        "p.yaml:29: tenants[7].api_keys[0]: env: must be followed by an environment variable's "
        "name",
        "p.yaml:32: tenants[8].api_keys[0]: file: must be followed by a path",
        "p.yaml:35: tenants[9].api_keys[0]: must not contain whitespace",
    ]
    assert not any("LEAKCHECK" in error for error in errors)  # a secret is never echoed


def test_a_key_is_one_tenants_whatever_form_each_entry_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_KEY", "sk-shared-0001")
    (tmp_path / "k").write_text("sk-shared-0001")
    errors = errors_of(
        tenant("alice", "sk-shared-0001"),
        tenant("bob", hashed_form("sk-shared-0001")),
        tenant("carol", "env:FAIRLANE_TEST_KEY"),
        tenant("dave", "file:k"),
        tenant("erin", "sk-erin-0001", hashed_form("sk-erin-0001")),
        base_dir=tmp_path,
    )
    short = hashed_form("sk-shared-0001")[:15]
    assert errors == [
        f"p.yaml:11: tenants[1].api_keys[0]: key {short}… is already used by tenant 'alice'",
        "p.yaml:14: tenants[2].api_keys[0]: key env:FAIRLANE_TEST_KEY is already used by "
        "tenant 'alice'",
        "p.yaml:17: tenants[3].api_keys[0]: key file:k is already used by tenant 'alice'",
        f"p.yaml:20: tenants[4].api_keys[1]: key {hashed_form('sk-erin-0001')[:15]}… is "
        "already used by tenant 'erin'",
    ]


def test_only_plaintext_keys_are_warned_about_with_their_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_KEY", "sk-from-env")
    policy = policy_of(
        tenant("a", "sk-plain-0001", hashed_form("x"), "env:FAIRLANE_TEST_KEY"),
        tenant("b", "sk-other-0001"),
    )
    assert [w.split(": warning: ")[0] for w in policy.warnings] == [
        "p.yaml:8: tenants[0].api_keys[0]",
        "p.yaml:11: tenants[1].api_keys[0]",
    ]
    assert "plaintext API key sk-p…" in policy.warnings[0]
    assert "sha256:" in policy.warnings[0] and "env:NAME or file:PATH" in policy.warnings[0]
    assert "sk-plain-0001" not in policy.warnings[0]


def test_past_twenty_plaintext_keys_the_rest_are_summed_up_in_one_warning() -> None:
    # A policy in force keeps its warnings: 100,000 tenants with plain keys would keep
    # 100,000 of them (~0.5 KiB each, as much as the rest of a tenant's memory).
    policy = policy_of(*(tenant(f"t{i}", f"sk-plain-{i:04d}") for i in range(PLAINTEXT + 5)))
    listed, summary = policy.warnings[:PLAINTEXT], policy.warnings[PLAINTEXT:]
    assert [w.split(": warning: ")[0] for w in listed][-1] == f"p.yaml:{5 + 3 * PLAINTEXT}: " + (
        f"tenants[{PLAINTEXT - 1}].api_keys[0]"
    )
    assert summary == (
        "p.yaml: warning: 5 more plaintext API keys, not listed: write it as sha256:HEX "
        "(`fairlane hash-key -` prints it), env:NAME or file:PATH to keep the secret out of "
        "the policy",
    )


def test_labels_never_show_a_usable_key() -> None:
    assert key_label("sk-chat-demo") == "sk-c…"
    assert key_label(hashed_form("k")) == hashed_form("k")[:15] + "…"
    assert key_label("env:CHAT_KEY") == "env:CHAT_KEY"
    assert key_label("file:/run/secrets/chat") == "file:/run/secrets/chat"


def test_tenants_built_in_code_hash_their_plain_and_sha256_keys() -> None:
    tier = Tier("fast", rank=0, priority=0, queue_limit=1, queue_deadline_s=1.0)
    a = Tenant("a", api_keys=("sk-a",), tiers=("fast",), default_tier="fast")
    b = Tenant("b", api_keys=(hashed_form("sk-b"),), tiers=("fast",), default_tier="fast")
    policy = Policy(tiers=(tier,), tenants=(a, b))
    assert policy.tenant_for_key("sk-a") is a
    assert policy.tenant_for_key("sk-b") is b
    assert "sk-a" not in repr(a)  # a plain key is a secret: out of repr
    with pytest.raises(ValueError, match="resolved when a policy is parsed"):
        Tenant("c", api_keys=("env:X",), tiers=("fast",), default_tier="fast")
    with pytest.raises(ValueError, match="64 hex digits"):
        self_contained_digest("sha256:00")


def test_index_handles_digests_sharing_their_first_bytes() -> None:
    """Buckets are keyed by 8 bytes of the digest; two keys whose digests share them (made
    up here: SHA-256 gives none in practice) are both found, by their full digest."""
    real = key_digest("sk-one")
    twin = real[:8] + bytes(24)
    index = KeyIndex([(real, "one"), (twin, "twin")])
    assert index.find("sk-one") == "one"
    assert index.find("sk-two") is None
    assert len(index) == 2


def test_a_lookup_among_many_keys_compares_one_digest_not_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100,000 keys: a lookup is one SHA-256 and a dict hit, not a scan. (Its time:
    ``python -m loadtests.bench.micro``, ``key-lookup``.)"""
    big = KeyIndex((key_digest(f"sk-{i}"), i) for i in range(100_000))
    compared: list[bytes] = []

    def compare_digest(stored: bytes, presented: bytes) -> bool:
        compared.append(stored)
        return stored == presented

    monkeypatch.setattr(keys_module.hmac, "compare_digest", compare_digest)
    assert big.find("sk-99999") == 99_999
    assert compared == [key_digest("sk-99999")]
    assert big.find("sk-unknown") is None
    assert len(compared) == 1  # a miss finds no bucket: nothing to compare


# --------------------------------------------------------------------------- rotation


def bump(path: Path, text: str) -> None:
    """Rewrite ``path`` and move its mtime (coarse-timestamp filesystems)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def test_rotation_by_hot_reload_keeps_old_and_new_keys_valid_while_both_are_listed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + tenant("chat", "sk-old-0001"))
    store = PolicyStore(path)

    def owner(key: str) -> str | None:
        found = store.current.tenant_for_key(key)
        return None if found is None else found.name

    assert (owner("sk-old-0001"), owner("sk-new-0001")) == ("chat", None)
    bump(path, HEAD + tenant("chat", "sk-old-0001", hashed_form("sk-new-0001")))
    assert store.reload() is True
    assert (owner("sk-old-0001"), owner("sk-new-0001")) == ("chat", "chat")
    bump(path, HEAD + tenant("chat", hashed_form("sk-new-0001")))
    assert store.reload() is True
    assert (owner("sk-old-0001"), owner("sk-new-0001")) == (None, "chat")


def test_a_reload_naming_an_unset_variable_keeps_the_keys_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAIRLANE_UNSET_KEY", raising=False)
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + tenant("chat", "sk-old-0001"))
    store = PolicyStore(path)
    bump(path, HEAD + tenant("chat", "env:FAIRLANE_UNSET_KEY"))
    assert store.reload() is False
    assert store.current.tenant_for_key("sk-old-0001") is not None


def test_parse_errors_name_the_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(HEAD + tenant("chat", "file:nope")))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors[0].startswith(f"{path}:8: tenants[0].api_keys[0]: cannot read")


def test_a_rotated_key_file_reloads_the_policy_without_an_edit(tmp_path: Path) -> None:
    """A secret mount updated in place: the store watches the files ``file:`` keys name."""
    key_file = tmp_path / "chat.key"
    key_file.write_text("sk-first-0001\n")
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + tenant("chat", "file:chat.key"))
    store = PolicyStore(path)
    assert store.current.key_files == (key_file,)
    assert store.reload() is False  # nothing changed
    bump(key_file, "sk-second-0001\n")
    assert store.reload() is True
    assert store.current.tenant_for_key("sk-first-0001") is None
    assert store.current.tenant_for_key("sk-second-0001") is not None
    assert store.reload() is False


def test_a_vanished_key_file_keeps_the_keys_in_force_until_it_is_back(tmp_path: Path) -> None:
    key_file = tmp_path / "chat.key"
    key_file.write_text("sk-first-0001")
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + tenant("chat", "file:chat.key"))
    store = PolicyStore(path)
    key_file.unlink()
    assert store.reload() is False  # refused: cannot read the key file; logged once
    assert store.reloads["error"] == 1
    assert store.reload() is False
    assert store.reloads["error"] == 1
    assert store.current.tenant_for_key("sk-first-0001") is not None
    key_file.write_text("sk-back-0001")
    assert store.reload() is True
    assert store.current.tenant_for_key("sk-back-0001") is not None
