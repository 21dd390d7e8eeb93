"""Backend credentials: reading keys by reference, and the forward rule that keeps a
request's retries and hedges on engines that take the key it carries."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from extproc.core.decisions import Forward
from extproc.fleet.backend import BackendSpec
from extproc.fleet.discovery import DnsBackendSpec
from extproc.transport.credentials import (
    BackendCredentials,
    CredentialError,
    parse_region_key,
    read_secret,
)
from extproc.wire import HEDGE_ON_TIMEOUT_HEADER, MAX_RETRIES_HEADER, PER_TRY_TIMEOUT_HEADER

KEY_A = "sk-backend-AAAA-0123456789"
KEY_B = "sk-backend-BBBB-0123456789"
A1, A2, B1 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000"


def test_read_secret_from_the_environment_and_from_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_KEY", KEY_A)
    assert read_secret("env:FAIRLANE_TEST_KEY") == KEY_A
    secret = tmp_path / "key"
    secret.write_text(f"{KEY_B}\n")  # a secret file ends with a newline
    assert read_secret(f"file:{secret}") == KEY_B


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("env:FAIRLANE_TEST_UNSET", "environment variable FAIRLANE_TEST_UNSET is not set"),
        ("env:FAIRLANE_TEST_EMPTY", "is empty"),
        ("file:/nonexistent/fairlane-key", "cannot read /nonexistent/fairlane-key"),
        ("sk-plaintext", "is not env:NAME or file:PATH"),
    ],
)
def test_read_secret_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, reference: str, message: str
) -> None:
    monkeypatch.delenv("FAIRLANE_TEST_UNSET", raising=False)
    monkeypatch.setenv("FAIRLANE_TEST_EMPTY", "  \n")
    with pytest.raises(CredentialError, match=message):
        read_secret(reference)


def test_read_secret_refuses_a_key_on_several_lines(tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text(f"{KEY_A}\n{KEY_B}\n")
    with pytest.raises(CredentialError, match="several lines") as caught:
        read_secret(f"file:{secret}")
    assert KEY_A not in str(caught.value)


def test_parse_region_key() -> None:
    assert parse_region_key("region-a=env:VLLM_KEY") == ("region-a", "env:VLLM_KEY")
    for bad in ("region-a", "=env:X", "region-a=sk-plain", "region-a=env:"):
        with pytest.raises(CredentialError, match="REGION=env:NAME"):
            parse_region_key(bad)


def _backends(a_key: str | None = None) -> tuple[BackendSpec, ...]:
    return (
        BackendSpec("10.0.0.1", 8000, "a", credential=a_key),
        BackendSpec("10.0.0.2", 8000, "a"),
        BackendSpec("10.0.1.1", 8000, "b"),
    )


def test_load_reads_each_key_once_and_never_logs_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_A", KEY_A)
    monkeypatch.setenv("FAIRLANE_TEST_B", KEY_B)
    caplog.set_level(logging.DEBUG)
    credentials = BackendCredentials.load(
        _backends(), [("a", "env:FAIRLANE_TEST_A"), ("b", "env:FAIRLANE_TEST_B")]
    )
    assert credentials is not None
    assert credentials.header_for(A1) == credentials.header_for(A2) == f"Bearer {KEY_A}"
    assert credentials.header_for(B1) == f"Bearer {KEY_B}"
    assert "env:FAIRLANE_TEST_A" in caplog.text  # where from, never what
    for text in (caplog.text, repr(credentials)):
        assert KEY_A not in text and KEY_B not in text


def test_a_backends_own_key_wins_over_its_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_A", KEY_A)
    monkeypatch.setenv("FAIRLANE_TEST_B", KEY_B)
    credentials = BackendCredentials.load(
        _backends(a_key="env:FAIRLANE_TEST_B"), [("a", "env:FAIRLANE_TEST_A")]
    )
    assert credentials is not None
    assert credentials.header_for(A1) == f"Bearer {KEY_B}"
    assert credentials.header_for(A2) == f"Bearer {KEY_A}"
    assert credentials.header_for(B1) is None  # region b wants no key


def test_load_without_keys_is_nothing_and_a_region_key_needs_its_region() -> None:
    assert BackendCredentials.load(_backends()) is None
    with pytest.raises(CredentialError, match="--region-key for c: no backend there"):
        BackendCredentials.load(_backends(), [("c", "env:X")])
    with pytest.raises(CredentialError, match="FAIRLANE_TEST_UNSET_TOO"):
        BackendCredentials.load(_backends(), [("a", "env:FAIRLANE_TEST_UNSET_TOO")])


def test_dns_backends_keys_are_read_at_load_and_given_to_each_address_that_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAIRLANE_TEST_A", KEY_A)
    monkeypatch.setenv("FAIRLANE_TEST_B", KEY_B)
    name = DnsBackendSpec("vllm", 8000, "c", credential="env:FAIRLANE_TEST_B")
    other = DnsBackendSpec("other", 8000, "a")  # takes region a's key
    credentials = BackendCredentials.load(_backends(), [("a", "env:FAIRLANE_TEST_A")], [name])
    assert credentials is not None
    monkeypatch.delenv("FAIRLANE_TEST_B")  # read at load: a later join needs no read
    credentials.add(name.member("10.0.0.7"))
    credentials.add(other.member("10.0.0.8"))
    assert credentials.header_for("10.0.0.7:8000") == f"Bearer {KEY_B}"
    assert credentials.header_for("10.0.0.8:8000") == f"Bearer {KEY_A}"
    credentials.forget("10.0.0.7:8000")
    assert credentials.header_for("10.0.0.7:8000") is None
    # a name's key that cannot be read stops the service before it serves
    with pytest.raises(CredentialError, match="FAIRLANE_TEST_UNSET_TOO"):
        BackendCredentials.load(
            (), [], [DnsBackendSpec("x", 1, credential="env:FAIRLANE_TEST_UNSET_TOO")]
        )
    # a region key for a region only a DNS backend has is not refused
    plain = DnsBackendSpec("vllm", 8000, "c")
    assert BackendCredentials.load((), [("c", "env:FAIRLANE_TEST_A")], [plain]) is not None


def _forward(endpoints: tuple[str, ...], **headers: str) -> Forward:
    return Forward(
        body=b"{}",
        endpoints=endpoints,
        set_headers={MAX_RETRIES_HEADER: str(len(endpoints) - 1), **headers},
        remove_headers=("authorization", "x-priority"),
    )


def test_one_key_for_the_fleet_keeps_every_alternate() -> None:
    key = f"Bearer {KEY_A}"
    credentials = BackendCredentials({A1: key, A2: key, B1: key})
    forward = credentials.apply(_forward((A1, B1, A2)))
    assert forward.endpoints == (A1, B1, A2)
    assert forward.set_headers["authorization"] == key
    assert forward.set_headers[MAX_RETRIES_HEADER] == "2"
    # the client's authorization is replaced, not both set and removed
    assert forward.remove_headers == ("x-priority",)


def test_retries_and_hedges_go_only_where_the_key_is_taken() -> None:
    credentials = BackendCredentials({A1: f"Bearer {KEY_A}", A2: f"Bearer {KEY_A}", B1: None})
    hedged = {PER_TRY_TIMEOUT_HEADER: "300", HEDGE_ON_TIMEOUT_HEADER: "true"}
    forward = credentials.apply(_forward((A1, B1, A2), **hedged))
    assert forward.endpoints == (A1, A2)  # B takes another key (here: none)
    assert forward.set_headers[MAX_RETRIES_HEADER] == "1"
    assert forward.set_headers[PER_TRY_TIMEOUT_HEADER] == "300"
    # first pick in region b: no key, and no alternate in region a (which wants one)
    alone = credentials.apply(_forward((B1, A1), **hedged))
    assert alone.endpoints == (B1,)
    assert "authorization" not in alone.set_headers
    assert "authorization" in alone.remove_headers  # the client's key still goes
    assert alone.set_headers[MAX_RETRIES_HEADER] == "0"
    assert PER_TRY_TIMEOUT_HEADER not in alone.set_headers
    assert HEDGE_ON_TIMEOUT_HEADER not in alone.set_headers


def test_a_forward_that_left_retries_to_the_route_gets_a_bound() -> None:
    """GET /v1/models: the gateway sets no retry count, and past the listed endpoints Envoy's
    fallback load balancer could pick an engine with another key."""
    credentials = BackendCredentials({A1: f"Bearer {KEY_A}", B1: f"Bearer {KEY_B}"})
    forward = credentials.apply(Forward(body=b"", endpoints=(A1, B1)))
    assert forward.endpoints == (A1,)
    assert forward.set_headers == {"authorization": f"Bearer {KEY_A}", MAX_RETRIES_HEADER: "0"}
