"""A real DNS server on loopback for ``dns://`` backends: Debian's dnsmasq, answering from a
hosts file the test rewrites while traffic flows.

dnsmasq runs in the foreground in the test's ``ProcessGroup`` (stopped with it, also on
failure), on a free port of 127.0.0.1, with nothing upstream (``--no-resolv``) and no
``/etc/hosts``: it knows only the names the test gives it, answered with ``ttl`` seconds.
``set`` writes the file, sends SIGHUP (dnsmasq re-reads its hosts files on it) and waits
until a query answers with the new set, so a test times from the moment the server serves
it.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import dns.exception
import dns.resolver

from extproc.ops.processes import Child, ProcessGroup, free_port, wait_port_open

MISSING = (
    "dnsmasq is not on PATH; scripts/setup-tools installs Debian's dnsmasq-base, or by hand: "
    "apt-get update && apt-get install -y --no-install-recommends dnsmasq-base"
)


class DnsmasqMissing(RuntimeError):
    def __init__(self) -> None:
        super().__init__(MISSING)


class DnsServer:
    """dnsmasq on ``127.0.0.1:port`` serving ``name``'s A records from a file."""

    def __init__(self, group: ProcessGroup, directory: Path, ttl_s: int = 1) -> None:
        self.group = group
        self.port = free_port()
        self.ttl_s = ttl_s
        self.hosts = directory / "dns-hosts"
        self.hosts.write_text("")
        self.child: Child | None = None
        self.records: dict[str, frozenset[str]] = {}

    @property
    def address(self) -> str:
        """``IP:PORT``, as ``--dns-server`` takes it."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("dnsmasq")
        if binary is None:
            raise DnsmasqMissing()
        argv = [
            binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            f"--port={self.port}",
            f"--addn-hosts={self.hosts}",
            f"--local-ttl={self.ttl_s}",
            "--user=root",  # its hosts file lies in the test's private directory
            "--pid-file=",
            "--log-facility=-",
        ]
        self.child = self.group.start(f"dnsmasq-{self.port}", argv)
        wait_port_open(self.port, self.child, timeout=10.0)
        self._wait_served()

    def stop(self) -> None:
        """SIGKILL: a DNS server that is gone (queries go unanswered)."""
        if self.child is not None:
            self.child.popen.kill()
            self.child.popen.wait()
            self.group.children.remove(self.child)
            self.child = None

    def set(self, name: str, ips: Iterable[str]) -> None:
        """``name`` now resolves to ``ips`` (empty: the name has no address)."""
        self.records[name] = frozenset(ips)
        lines = [f"{ip} {n}" for n, addresses in self.records.items() for ip in sorted(addresses)]
        self.hosts.write_text("".join(f"{line}\n" for line in lines))
        if self.child is not None:
            self.child.popen.send_signal(signal.SIGHUP)
            self._wait_served()

    def resolve(self, name: str) -> frozenset[str]:
        """What the server answers for ``name`` now (A records; empty when none)."""
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        resolver.lifetime = 2.0
        try:
            answer = resolver.resolve(name, "A", raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return frozenset()
        return frozenset(r.address for r in answer.rrset) if answer.rrset else frozenset()

    def _wait_served(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self.resolve(n) == ips for n, ips in self.records.items()):
                    return
            except dns.exception.DNSException:
                pass
            assert time.monotonic() < deadline, f"dnsmasq did not serve {self.records} in time"
            time.sleep(0.05)
