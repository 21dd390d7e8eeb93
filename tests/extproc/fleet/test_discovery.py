"""``dns://NAME:PORT`` backends: parsing, clear errors, and mixing them with fixed ones."""

from __future__ import annotations

import pytest

from extproc.fleet.backend import BackendSpec, backend_argument
from extproc.fleet.discovery import (
    DnsBackendSpec,
    FleetSpec,
    is_dns_backend,
    parse_dns_backend,
)


def test_parse_a_dns_backend_with_region_and_options() -> None:
    spec = parse_dns_backend("us=dns://vllm.llm.svc.cluster.local:8000#seats=64,key=env:K")
    assert spec == DnsBackendSpec(
        "vllm.llm.svc.cluster.local", 8000, "us", seats=64, credential="env:K"
    )
    assert spec.url == "dns://vllm.llm.svc.cluster.local:8000"
    assert parse_dns_backend("dns://vllm:8000") == DnsBackendSpec("vllm", 8000, "default")
    assert parse_dns_backend(backend_argument(spec)) == spec  # round trip, as `up` hands it on


def test_every_address_is_a_backend_with_the_names_settings() -> None:
    spec = DnsBackendSpec("vllm", 8000, "eu", weight=2, seats=8, credential="file:/k")
    assert spec.member("10.0.0.7") == BackendSpec("10.0.0.7", 8000, "eu", 2, 8, "file:/k")
    assert spec.member("fd00::7").address == "[fd00::7]:8000"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("dns://vllm", "the port is required"),
        ("eu=dns://vllm:", "the port is required"),
        ("dns://vllm:port", "the port is required"),
        ("dns://vllm:8000/v1", "the port is required"),
        ("dns://vllm:0", r"port must be in \[1, 65535\]"),
        ("dns://vllm:70000", r"port must be in \[1, 65535\]"),
        ("dns://:8000", "the name is empty"),
        ("dns://10.0.0.5:8000", "an IP address, not a name: write http://IP:PORT"),
        ("dns://bad name:8000", "not a DNS name"),
        ("dns://-vllm:8000", "not a DNS name"),
        ("dns://a..b:8000", "not a DNS name"),
        ("dns://vllm:8000#seats=0", "seats must be a whole number >= 1"),
        ("dns://vllm:8000#key=sk-123", "key must be env:NAME or file:PATH"),
        ("dns://vllm:8000#slots=3", "unknown option 'slots=3'"),
    ],
)
def test_a_malformed_dns_backend_says_what_is_wrong(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_dns_backend(bad)
    assert bad in str(caught.value)  # the whole argument is named


def test_dns_backends_are_told_apart_from_fixed_ones() -> None:
    assert is_dns_backend("dns://vllm:8000")
    assert is_dns_backend("eu=DNS://vllm:8000#seats=2")
    assert not is_dns_backend("eu=http://10.0.0.5:8000")
    assert not is_dns_backend("10.0.0.5:8000#key=env:dns://x")


def test_a_fleet_mixes_both_kinds_and_keeps_the_regions_in_the_order_named() -> None:
    fleet = FleetSpec.parse(
        ["b=dns://vllm-b:8000", "a=http://10.0.0.5:8000", "b=http://10.0.0.6:8000", "c=dns://c:1"]
    )
    assert fleet.static == (BackendSpec("10.0.0.5", 8000, "a"), BackendSpec("10.0.0.6", 8000, "b"))
    assert fleet.dns == (DnsBackendSpec("vllm-b", 8000, "b"), DnsBackendSpec("c", 1, "c"))
    assert fleet.regions == ("b", "a", "c")  # the DNS backend named region b first
    assert fleet.dynamic and not FleetSpec.parse(["10.0.0.5:1"]).dynamic


def test_a_name_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="dns://vllm:8000 is listed twice"):
        FleetSpec.parse(["a=dns://vllm:8000", "b=dns://vllm:8000"])
