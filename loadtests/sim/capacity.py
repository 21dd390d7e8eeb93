"""How much load one simulator process can serve: a benchmark of the simulator itself.

A load test is only as good as its target: if the simulator runs out of CPU, latencies
measured through the gateway are the simulator's, not the simulated GPU's. This starts
``fairlane sim`` as a child process on 127.0.0.1, keeps N streaming chat requests in flight
for a fixed time, and reports the child's CPU use (from ``/proc/<pid>/stat``), the token
and request throughput, and the client's own CPU, so a client-bound run is recognisable.

    .venv/bin/python -m loadtests.sim.capacity --concurrency 200 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from dataclasses import dataclass

import aiohttp

from extproc.ops.processes import ProcessGroup, free_port, wait_http_ready

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    errors: int = 0


async def client(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    deadline: float,
    totals: Totals,
) -> None:
    """One user: streaming requests back to back until ``deadline``."""
    while time.monotonic() < deadline:
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    totals.errors += 1
                    await resp.read()
                    continue
                events = 0
                async for data in resp.content.iter_any():
                    events += data.count(b"data: ")
                totals.tokens += max(events - 2, 0)  # minus the role chunk and [DONE]
                totals.requests += 1
        except aiohttp.ClientError:
            totals.errors += 1


async def scrape_running(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else -1.0


async def drive(args: argparse.Namespace, base: str, pid: int) -> None:
    body: dict[str, object] = {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "hello world " * args.prompt_words}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    totals = Totals()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start_wall = time.monotonic()
        deadline = start_wall + args.warmup + args.duration
        tasks = [
            asyncio.create_task(
                client(session, base + "/v1/chat/completions", body, deadline, totals)
            )
            for _ in range(args.concurrency)
        ]
        await asyncio.sleep(args.warmup)
        sim_cpu0, my_cpu0, t0 = cpu_seconds(pid), time.process_time(), time.monotonic()
        req0, tok0 = totals.requests, totals.tokens
        await asyncio.sleep(args.duration / 2)
        running = await scrape_running(session, base)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        sim_cpu1, my_cpu1, t1 = cpu_seconds(pid), time.process_time(), time.monotonic()
        req1, tok1 = totals.requests, totals.tokens
        await asyncio.gather(*tasks)

    wall = t1 - t0
    sim_cores = (sim_cpu1 - sim_cpu0) / wall
    client_cores = (my_cpu1 - my_cpu0) / wall
    print(
        f"concurrency {args.concurrency}, {args.duration:.0f}s measured after "
        f"{args.warmup:.0f}s warm-up, speedup {args.speedup:g}, profile {args.profile}"
    )
    print(f"  vllm:num_requests_running mid-run: {running:.0f}")
    print(
        f"  throughput: {(tok1 - tok0) / wall:,.0f} tokens/s, "
        f"{(req1 - req0) / wall:.1f} requests/s, {totals.errors} errors"
    )
    print(f"  sim CPU: {sim_cores:.2f} cores   client CPU: {client_cores:.2f} cores")
    if client_cores > 0.9:
        print("  the client was the bottleneck (>0.9 core): the sim may do more than this")
    verdict = "PASS" if sim_cores < 0.5 and running >= args.concurrency * 0.9 else "FAIL"
    print(f"  target (>= {args.concurrency} streams under 0.5 core): {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--profile", default="llama-8b-h100")
    args = parser.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup() as group:
        child = group.start(
            "sim",
            [
                sys.executable,
                "-m",
                "extproc.ops.cli",
                "sim",
                "--port",
                str(port),
                "--speedup",
                str(args.speedup),
                "--profile",
                args.profile,
            ],
        )
        wait_http_ready(base + "/health", child)
        asyncio.run(drive(args, base, child.popen.pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
