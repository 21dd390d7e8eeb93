"""Dynamic fleets through the real stack: a real DNS server (dnsmasq on loopback) serves a
name whose addresses the test changes while steady mixed traffic flows through the real
Envoy, the service follows the name (``dns://``) and serves Envoy the host set over EDS,
and simulated engines listen on loopback addresses 127.0.0.11-14 (one per "pod", all on one
port, as behind a headless Service).

- scale 2 -> 4: the new engines get traffic within 2 resolution periods of appearing;
- scale 4 -> 1: no request fails, those in flight on the departing engines finish there,
  which then leave Envoy's host set too;
- a rolling replacement of every engine: no request fails;
- a DNS outage: the last known set is kept and the failures are counted.

Run with ``-s`` to see the figures each test measured (docs/benchmarks/scale.md reports them).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.fleet.discovery import DnsBackendSpec
from extproc.ops.processes import Child, ProcessGroup, free_port, wait_http_ready
from extproc.ops.up import Stack, StackConfig
from extproc.wire import BACKEND_CLUSTER
from tests.dns_server import DnsmasqMissing, DnsServer
from tests.exported_metrics import Samples, parse_samples
from tests.integration.conftest import DEMO_TENANTS, auth, read_request_log

pytestmark = pytest.mark.integration

NAME = "vllm.fairlane.test"
IPS = ("127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14")
PERIOD_S = 1.0
"""The service resolves the name this often (``--dns-interval``): one resolution period."""
MODEL = "sim-model"
KEYS = ("sk-chat-demo", "sk-api-demo", "sk-batch-demo")
"""The steady load cycles through the three tiers."""
WAIT_S = 20.0

POLICY = f"""\
max_body_bytes: 65536
max_in_flight_per_backend: 32
on_escalation: downgrade
tiers:
  - name: interactive
    priority: 0
    queue_limit: 256
    queue_deadline_s: 30
    gate: {{max_waiting: 8}}
  - name: api
    priority: 10
    queue_limit: 256
    queue_deadline_s: 30
    gate: {{max_waiting: 8}}
  - name: batch
    priority: 20
    queue_limit: 256
    queue_deadline_s: 30
    gate: {{max_waiting: 4, max_itl_ms: null}}
{DEMO_TENANTS}"""


@dataclass
class Outcome:
    test_id: str
    sent_at: float  # time.time(), as in the simulators' logs
    status: int  # 0: no response (connection error or timeout)
    error: str = ""


@dataclass
class Fleet:
    """dnsmasq, four simulated engines (only those in DNS are in the fleet) and the stack."""

    group: ProcessGroup
    dns: DnsServer
    port: int
    sims: dict[str, Child] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    stack: Stack | None = None

    @property
    def gateway(self) -> Stack:
        assert self.stack is not None
        return self.stack

    def address(self, ip: str) -> str:
        return f"{ip}:{self.port}"

    def resolve_to(self, ips: tuple[str, ...]) -> None:
        self.dns.set(NAME, ips)

    def requests(self, ip: str) -> list[dict[str, Any]]:
        return read_request_log(self.logs[ip])

    def metrics(self) -> Samples:
        url = f"http://127.0.0.1:{self.gateway.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=3) as response:
            return parse_samples(response.read().decode())

    def members(self) -> dict[str, str]:
        """Backend address -> its state (serving, warming, draining), as exported."""
        return {
            dict(labels)["backend"]: dict(labels)["state"]
            for (name, labels), value in self.metrics().items()
            if name == "fairlane_backend_membership" and value == 1
        }

    def envoy_hosts(self) -> set[str]:
        """The backends' cluster's hosts as Envoy holds them (learned over EDS)."""
        url = f"{self.gateway.admin_url}/clusters?format=json"
        with urllib.request.urlopen(url, timeout=3) as response:
            clusters = json.load(response)["cluster_statuses"]
        (backends,) = [c for c in clusters if c["name"] == BACKEND_CLUSTER]
        return {
            f"{h['address']['socket_address']['address']}:"
            f"{h['address']['socket_address']['port_value']}"
            for h in backends.get("host_statuses", [])
        }

    def counter(self, sample_name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(
            value
            for (sample, sample_labels), value in self.metrics().items()
            if sample == sample_name and want <= set(sample_labels)
        )


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll ``condition`` (in a thread: it does blocking I/O) until it holds; the time it
    took. Fails naming ``what`` after ``timeout_s``."""
    started = time.monotonic()
    while not await asyncio.to_thread(condition):
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def dynamic_fleet(tmp: Path, first: tuple[str, ...]) -> AsyncIterator[Fleet]:
    """The fleet with ``first`` in DNS, every part stopped at the end, also on failure."""
    group = ProcessGroup(tmp / "logs")
    try:
        dns = DnsServer(group, tmp)
        try:
            dns.start()
        except DnsmasqMissing as missing:
            pytest.fail(str(missing), pytrace=False)
        fleet = Fleet(group, dns, free_port())
        await asyncio.to_thread(_start_engines, fleet)
        fleet.resolve_to(first)
        policy = tmp / "policy.yaml"
        policy.write_text(POLICY)
        config = StackConfig(
            port=free_port(),
            policy_path=policy,
            dns_backends=(DnsBackendSpec(NAME, fleet.port, "region-a"),),
            service_args=("--dns-server", dns.address, "--dns-interval", str(PERIOD_S)),
        )
        fleet.stack = await asyncio.to_thread(Stack(config, group).start)
        expected = {fleet.address(ip) for ip in first}
        await until(
            lambda: (
                fleet.members() == dict.fromkeys(expected, "serving")
                and fleet.envoy_hosts() == expected
            ),
            "the first engines serving, and in Envoy's host set",
        )
        yield fleet
    finally:
        await asyncio.to_thread(group.stop)


def _start_engines(fleet: Fleet) -> None:
    for ip in IPS:
        log = fleet.group.log_dir / f"requests-{ip}.jsonl"
        argv = [
            *(sys.executable, "-m", "extproc", "sim", "--host", ip, "--port", str(fleet.port)),
            *("--model", MODEL, "--scheduling-policy", "priority", "--log-requests", str(log)),
        ]
        fleet.sims[ip] = fleet.group.start(f"sim-{ip}", argv)
        fleet.logs[ip] = log
    for ip, child in fleet.sims.items():
        wait_http_ready(f"http://{ip}:{fleet.port}/health", child, timeout=30)


class Load:
    """Steady mixed traffic: ``workers`` clients, each sending one request after another,
    cycling through the tiers, until stopped."""

    def __init__(self, fleet: Fleet, workers: int, max_tokens: int) -> None:
        self.fleet = fleet
        self.workers = workers
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._ids = itertools.count()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)
        await self._session.close()

    async def _worker(self, index: int) -> None:
        url = self.fleet.gateway.url + "/v1/chat/completions"
        while not self._stop.is_set():
            number = next(self._ids)
            test_id = f"w{index}-{number}"
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Hello {number}"}],
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
            }
            headers = {**auth(KEYS[number % len(KEYS)]), "x-test-id": test_id}
            sent_at = time.time()
            try:
                async with self._session.post(
                    url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
                ) as response:
                    text = await response.read()
                    error = "" if response.status == 200 else text[:300].decode(errors="replace")
                    self.outcomes.append(Outcome(test_id, sent_at, response.status, error))
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.outcomes.append(Outcome(test_id, sent_at, 0, repr(exc)))

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]

    def answered_since(self, since: float) -> int:
        """How many requests sent after ``since`` have been answered (or failed)."""
        return sum(1 for o in self.outcomes if o.sent_at >= since)


def arrivals(fleet: Fleet, ip: str, since: float) -> list[float]:
    """When the engine at ``ip`` received each load request sent after ``since``."""
    return sorted(
        r["time"]
        for r in fleet.requests(ip)
        if r["time"] >= since and r["headers"].get("x-test-id")
    )


# ----------------------------------------------------------------------------- the tests


async def test_new_engines_get_traffic_within_two_resolution_periods(tmp_path: Path) -> None:
    async with dynamic_fleet(tmp_path, IPS[:2]) as fleet, Load(fleet, 6, 16) as load:
        await until(lambda: len(load.outcomes) >= 30, "traffic flowing on two engines")
        appeared = time.time()
        fleet.resolve_to(IPS)  # returns once dnsmasq answers with all four
        served = time.time()
        new = IPS[2:]
        await until(
            lambda: all(arrivals(fleet, ip, appeared) for ip in new), "the new engines' traffic"
        )
        first = {ip: arrivals(fleet, ip, appeared)[0] - appeared for ip in new}
        settled = appeared + 2 * PERIOD_S
        await until(  # the four share the load: a few dozen requests each
            lambda: load.answered_since(settled) >= 24 * len(IPS), "requests on the four engines"
        )
        hosts = fleet.envoy_hosts()
    assert not load.failed(), load.failed()[:5]
    shares = {ip: len(arrivals(fleet, ip, settled)) for ip in IPS}
    total = sum(shares.values())
    print(
        f"\nscale 2->4 (resolution period {PERIOD_S:g}s; DNS served the new set "
        f"{served - appeared:.2f}s after the change): first request on each new engine "
        + ", ".join(f"{ip} {s:.2f}s" for ip, s in first.items())
        + f"; share of the {total} requests after {2 * PERIOD_S:g}s: "
        + ", ".join(f"{ip} {n / total:.0%}" for ip, n in shares.items())
        + f"; {len(load.outcomes)} requests, {len(load.failed())} failed"
    )
    assert max(first.values()) <= 2 * PERIOD_S, first
    # each takes a share: at least a third of an even one (a few dozen requests each; an
    # engine left out would have none)
    assert all(n / total >= 1 / (3 * len(IPS)) for n in shares.values()), shares
    assert hosts == {fleet.address(ip) for ip in IPS}


async def test_scale_down_drains_departing_engines_without_a_failed_request(
    tmp_path: Path,
) -> None:
    keep = IPS[:1]
    async with dynamic_fleet(tmp_path, IPS) as fleet:
        async with Load(fleet, 8, 96) as load:
            await until(lambda: len(load.outcomes) >= 16, "traffic flowing on four engines")
            gone = {fleet.address(ip) for ip in IPS[1:]}
            in_flight_seen: dict[str, float] = {}

            def drained() -> bool:
                samples = fleet.metrics()
                for (name, labels), value in samples.items():
                    backend = dict(labels).get("backend")
                    if name == "fairlane_backend_in_flight" and backend in gone and value:
                        in_flight_seen[backend] = max(in_flight_seen.get(backend, 0), value)
                removed = samples.get(
                    ("fairlane_fleet_changes_total", frozenset({("change", "removed")})), 0
                )
                return removed >= len(gone)

            started = time.time()
            fleet.resolve_to(keep)
            took = await until(drained, "the departing engines drained and removed")
            hosts_after = fleet.envoy_hosts()
            members_after = fleet.members()
            removed_at = time.time()
            for ip in IPS[1:]:  # nothing is sent there any more: stop them, as a pod would
                fleet.sims[ip].popen.terminate()
            await until(
                lambda: load.answered_since(removed_at) >= 16, "requests sent after the removal"
            )
        late = {ip: arrivals(fleet, ip, removed_at) for ip in IPS[1:]}
        finished_there = [
            o
            for o in load.outcomes
            if o.sent_at < started
            and any(
                r["headers"].get("x-test-id") == o.test_id
                for ip in IPS[1:]
                for r in fleet.requests(ip)
            )
        ]
    print(
        f"\nscale 4->1: the three departing engines drained and were removed {took:.2f}s "
        f"after the change; in flight there while draining (most seen): {in_flight_seen}; "
        f"{len(load.outcomes)} requests, {len(load.failed())} failed"
    )
    assert not load.failed(), load.failed()[:5]
    assert in_flight_seen, "no request was in flight on a departing engine: nothing drained"
    assert finished_there and all(o.status == 200 for o in finished_there)
    assert hosts_after == {fleet.address(ip) for ip in keep}
    assert members_after == {fleet.address(keep[0]): "serving"}
    assert not any(late.values()), late


async def test_a_rolling_replacement_of_every_engine_fails_no_request(tmp_path: Path) -> None:
    steps = (IPS[:2], IPS[1:3], IPS[2:4])
    async with dynamic_fleet(tmp_path, steps[0]) as fleet, Load(fleet, 6, 48) as load:
        await until(lambda: len(load.outcomes) >= 12, "traffic flowing")
        timings = []
        for step in steps[1:]:
            wanted = dict.fromkeys((fleet.address(ip) for ip in step), "serving")

            def settled(wanted: dict[str, str] = wanted) -> bool:
                return fleet.members() == wanted and fleet.envoy_hosts() == set(wanted)

            fleet.resolve_to(step)
            timings.append(await until(settled, f"the fleet becoming {step}"))
        moved_at = time.time()
        await until(
            lambda: (
                load.answered_since(moved_at) >= 12
                and bool(arrivals(fleet, IPS[2], moved_at))
                and bool(arrivals(fleet, IPS[3], moved_at))
            ),
            "requests sent after the last step, on both new engines",
        )
    print(
        "\nrolling replacement {11,12} -> {12,13} -> {13,14}: each step settled in "
        + ", ".join(f"{t:.2f}s" for t in timings)
        + f"; {len(load.outcomes)} requests, {len(load.failed())} failed"
    )
    assert not load.failed(), load.failed()[:5]
    assert not arrivals(fleet, IPS[0], moved_at) and not arrivals(fleet, IPS[1], moved_at)
    assert arrivals(fleet, IPS[2], moved_at) and arrivals(fleet, IPS[3], moved_at)


async def test_a_dns_outage_keeps_the_last_known_set_and_is_counted(tmp_path: Path) -> None:
    name = f"dns://{NAME}"
    async with dynamic_fleet(tmp_path, IPS[:2]) as fleet, Load(fleet, 4, 16) as load:
        source = f"{name}:{fleet.port}"
        await until(lambda: len(load.outcomes) >= 12, "traffic flowing")
        fleet.dns.stop()
        outage = time.time()
        await until(
            lambda: (
                fleet.counter("fairlane_dns_failures_total", name=source) >= 2
                and fleet.counter("fairlane_dns_failing", name=source) == 1
            ),
            "the failed resolutions counted",
        )
        await until(
            lambda: all(arrivals(fleet, ip, outage) for ip in IPS[:2]),
            "both engines served during the outage",
        )
        during = fleet.members()
        served_during = {ip: len(arrivals(fleet, ip, outage)) for ip in IPS[:2]}
        failures = fleet.counter("fairlane_dns_failures_total", name=source)
        # The server is back, with a third engine: it joins, the count stops growing.
        fleet.dns.start()
        fleet.resolve_to(IPS[:3])
        await until(lambda: bool(arrivals(fleet, IPS[2], outage)), "the third engine's traffic")
        assert fleet.counter("fairlane_dns_failing", name=source) == 0
    print(
        f"\nDNS outage: {failures:g} failed resolutions counted; the set kept: {during}; "
        f"requests per engine during the outage: {served_during}; "
        f"{len(load.outcomes)} requests, {len(load.failed())} failed"
    )
    assert during == dict.fromkeys((fleet.address(ip) for ip in IPS[:2]), "serving")
    assert all(served_during.values()), served_during
    assert not load.failed(), load.failed()[:5]
