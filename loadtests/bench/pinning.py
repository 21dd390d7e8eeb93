"""Which cores the engines get and which the gateway and the load generator get.

On a small machine a real engine, Envoy, the service and the load generator fight for the
same cores, and every latency then measures the machine. Pinning the engines to one set of
cores and everything of the gateway's side (and the bench itself, whose children inherit
its affinity) to the other keeps the gateway's figures the gateway's: whether its own
cores were saturated is then a question about those cores alone (:mod:`loadtests.bench.cpu`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MAX_GATEWAY_CPUS = 4
"""The default split's cap on the gateway's side: Envoy, one service process per replica
and the load generator use a few cores at most; the engines take the rest."""


class PinningError(ValueError):
    """A core split that cannot be used; the message says which option and why."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,6"`` as ``{0, 1, 2, 3, 6}`` (the kernel's and taskset's list format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise PinningError(f"not a CPU list: {text!r} (e.g. 0-3,6)") from None
        if first < 0 or last < first:
            raise PinningError(f"not a CPU range: {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise PinningError(f"no CPU in {text!r}")
    return frozenset(cpus)


def cpu_list_text(cpus: Iterable[int]) -> str:
    """The shortest list form of ``cpus`` (``{0, 1, 2, 5}`` as ``"0-2,5"``), as vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` and taskset read it."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = previous = None
    for cpu in [*ordered, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)


@dataclass(frozen=True)
class CpuSplit:
    """The engines' cores and the gateway side's, disjoint."""

    engine: frozenset[int]
    gateway: frozenset[int]

    def engine_shares(self, count: int) -> list[frozenset[int]]:
        """The cores of each of ``count`` engines: the engine cores dealt out in order, as
        evenly as they go (with fewer cores than engines, engines share a core)."""
        ordered = sorted(self.engine)
        if count <= len(ordered):
            size, extra = divmod(len(ordered), count)
            shares, start = [], 0
            for i in range(count):
                end = start + size + (1 if i < extra else 0)
                shares.append(frozenset(ordered[start:end]))
                start = end
            return shares
        return [frozenset({ordered[i % len(ordered)]}) for i in range(count)]


def split_cpus(
    available: Collection[int],
    engine: frozenset[int] | None = None,
    gateway: frozenset[int] | None = None,
) -> CpuSplit:
    """The split of ``available`` (this process's affinity): the sets given, the rest of
    ``available`` for a side not given, or by default the gateway the last half (at most
    :data:`MAX_GATEWAY_CPUS`) and the engines the first."""
    pool = frozenset(available)
    for option, cpus in (("--engine-cpus", engine), ("--gateway-cpus", gateway)):
        if cpus is not None and not cpus <= pool:
            outside = cpu_list_text(cpus - pool)
            raise PinningError(
                f"{option}: CPU {outside} is not available to this process "
                f"(available: {cpu_list_text(pool)})"
            )
    if engine is None and gateway is None:
        if len(pool) < 2:
            raise PinningError(
                f"only CPU {cpu_list_text(pool)} is available: pinning needs two, one for "
                "the engines and one for the gateway (run with --no-pin)"
            )
        ordered = sorted(pool)
        take = min(MAX_GATEWAY_CPUS, len(ordered) // 2)
        return CpuSplit(frozenset(ordered[:-take]), frozenset(ordered[-take:]))
    engine = engine if engine is not None else pool - (gateway or frozenset())
    gateway = gateway if gateway is not None else pool - engine
    if not engine or not gateway:
        side = "--engine-cpus" if not engine else "--gateway-cpus"
        raise PinningError(f"{side}: no CPU left for that side of {cpu_list_text(pool)}")
    if engine & gateway:
        shared = cpu_list_text(engine & gateway)
        raise PinningError(f"--engine-cpus and --gateway-cpus share CPU {shared}")
    return CpuSplit(engine, gateway)


@dataclass(frozen=True)
class Pinning:
    """How a run placed its processes, for the report: the split, and whether the bench
    started (and so pinned) the engines or they were someone else's (``--backend``)."""

    split: CpuSplit
    engines_pinned: bool
    engine_cpus: dict[str, str] = field(default_factory=dict)
    """Each engine the bench started -> the cores it was pinned to (its OpenMP threads
    bound to the same list, as many threads as cores)."""

    def to_json(self) -> dict[str, object]:
        return {
            "engine_cpus": cpu_list_text(self.split.engine),
            "gateway_cpus": cpu_list_text(self.split.gateway),
            "engines_pinned": self.engines_pinned,
            "engines": dict(self.engine_cpus),
        }


def pin_process(cpus: Collection[int]) -> None:
    """Pin every thread of this process to ``cpus`` (Linux's affinity is per thread; the
    threads and processes started afterwards inherit it)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def children_pinned(cpus: Collection[int]) -> Iterator[None]:
    """Within the block, processes this thread starts run on ``cpus`` (a child inherits
    the affinity of the thread that forks it): no wrapper command, no window in which the
    child runs elsewhere. The thread's own affinity is put back on the way out."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def affinities(pids: Mapping[str, int]) -> dict[str, str]:
    """The cores each process may run on now, as the kernel says (gone ones left out)."""
    found = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            found[name] = cpu_list_text(os.sched_getaffinity(pid))
    return found
