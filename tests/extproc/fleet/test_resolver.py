"""Resolving ``dns://`` backends against a real DNS server (dnsmasq on loopback): addresses
and TTL, failures that keep the last known set, and the schedule between resolutions."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.fleet.backend import BackendPool
from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.membership import Changes, Membership
from extproc.fleet.resolver import (
    DEFAULT_MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    DnsError,
    DnsLookup,
    DnsWatcher,
    hosts_addresses,
    next_interval,
    parse_nameserver,
)
from extproc.ops.processes import ProcessGroup, free_port
from tests.dns_server import DnsmasqMissing, DnsServer
from tests.polling import until

NAME = "vllm.fairlane.test"
WAIT_S = 10.0


@pytest.fixture
def dns(processes: ProcessGroup, tmp_path: Path) -> Iterator[DnsServer]:
    server = DnsServer(processes, tmp_path, ttl_s=7)
    try:
        server.start()
    except DnsmasqMissing as missing:
        pytest.fail(str(missing), pytrace=False)
    yield server
    server.stop()


def lookup(server: DnsServer) -> DnsLookup:
    return DnsLookup(("127.0.0.1", server.port), timeout_s=1.0)


async def test_every_address_and_the_ttl(dns: DnsServer) -> None:
    dns.set(NAME, ["10.0.0.1", "10.0.0.2"])
    addresses, ttl = await lookup(dns).resolve(NAME)
    assert addresses == {"10.0.0.1", "10.0.0.2"}
    assert ttl == 7  # dnsmasq's --local-ttl


async def test_an_unknown_name_and_a_dead_server_are_failures(dns: DnsServer) -> None:
    dns.set(NAME, ["10.0.0.1"])
    with pytest.raises(DnsError):
        await lookup(dns).resolve("nobody.fairlane.test")
    dead = DnsLookup(("127.0.0.1", free_port()), timeout_s=0.5)
    with pytest.raises(DnsError):
        await dead.resolve(NAME)


async def test_the_watcher_follows_the_name_and_keeps_the_set_through_an_outage(
    dns: DnsServer,
) -> None:
    source = DnsBackendSpec(NAME, 8000, "a")
    pool = BackendPool((), regions=("a",), dynamic=True)
    members = Membership(pool, (source,))
    seen: list[Changes] = []
    watcher = DnsWatcher(members, lookup(dns), seen.append, pool.clock, interval_s=0.5)
    dns.set(NAME, ["10.0.0.1"])
    await watcher.refresh_all()
    assert set(pool.by_address) == {"10.0.0.1:8000"} and seen[0].joined == ["10.0.0.1:8000"]
    running = asyncio.create_task(watcher.run())
    try:
        dns.set(NAME, ["10.0.0.1", "10.0.0.2"])
        await until(lambda: "10.0.0.2:8000" in pool.by_address, "the new address", WAIT_S, 0.05)
        dns.stop()
        await until(lambda: members.failures[source.url] >= 1, "a failure counted", WAIT_S, 0.05)
        assert source.url in members.failing
        assert set(pool.by_address) == {"10.0.0.1:8000", "10.0.0.2:8000"}  # kept
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def test_the_next_resolution_follows_the_ttl_within_bounds() -> None:
    assert next_interval(3.0, None, DEFAULT_MAX_INTERVAL_S) == 3.0
    assert next_interval(0.0, None, DEFAULT_MAX_INTERVAL_S) == MIN_INTERVAL_S  # no busy loop
    assert next_interval(3600.0, None, DEFAULT_MAX_INTERVAL_S) == DEFAULT_MAX_INTERVAL_S
    assert next_interval(3600.0, 2.0, DEFAULT_MAX_INTERVAL_S) == 2.0  # --dns-interval wins
    assert next_interval(1.0, 0.01, DEFAULT_MAX_INTERVAL_S) == MIN_INTERVAL_S


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.0.0.53", ("10.0.0.53", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("[fd00::53]:5353", ("fd00::53", 5353)),
        ("fd00::53", ("fd00::53", 53)),
    ],
)
def test_parse_nameserver(text: str, parsed: tuple[str, int]) -> None:
    assert parse_nameserver(text) == parsed


@pytest.mark.parametrize("bad", ["dns.local", "10.0.0.1:x", "10.0.0.1:0", "[fd00::1]x", ""])
def test_a_bad_nameserver_says_the_syntax(bad: str) -> None:
    with pytest.raises(ValueError, match=r"IP\[:PORT\]"):
        parse_nameserver(bad)


def test_a_name_only_the_hosts_file_knows_resolves_as_getaddrinfo_would() -> None:
    text = "127.0.0.1 localhost\n::1 localhost ip6-localhost  # loopback\n10.0.0.9 other\n"
    assert hosts_addresses(text, "localhost") == {"127.0.0.1", "::1"}
    assert hosts_addresses(text, "LOCALHOST.") == {"127.0.0.1", "::1"}
    assert hosts_addresses("# 10.0.0.1 localhost\nnot-an-ip localhost\n", "localhost") == set()


async def test_the_hosts_file_is_read_before_dns(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 vllm-local\n")
    try:
        lookup = DnsLookup(hosts_file=hosts)
    except DnsError:
        pytest.fail("this machine has no /etc/resolv.conf")
    addresses, ttl = await lookup.resolve("vllm-local")
    assert addresses == {"127.0.0.1"} and ttl == math.inf
    assert next_interval(ttl, None, 5.0) == 5.0
