"""``python -m loadtests.bench.replicas.redis_outage``: Redis stopped under load, and fairness.

Three replicas (``fairlane up --replicas 3``'s stack: the real Envoy, a local Redis, two
simulated vLLM engines of 4 seats each) serve two tenants of one tier: ``heavy`` keeps
``--heavy`` requests outstanding, ``light`` one at a time. Redis is SIGKILLed at
``--outage-at`` seconds and started again (empty) ``--outage`` seconds later. Reported, for
the windows before, during and after the outage: requests and failures, the light tenant's
median and p95 latency (fairness: VTC keeps it near one request's service while heavy's
backlog waits), and each tenant's share of the completed requests. It prints one JSON
object and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.redis_server import start_redis
from extproc.ops.up import Stack, StackConfig
from extproc.policy import DEFAULT_POLICY_PATH

POLICY_TENANTS = (
    "tenants:\n"
    "  - name: heavy\n    api_keys: [sk-heavy]\n    tiers: [api]\n"
    "  - name: light\n    api_keys: [sk-light]\n    tiers: [api]\n"
)


@dataclass(frozen=True)
class Outcome:
    tenant: str
    started: float
    finished: float
    status: int


def write_policy(folder: Path) -> Path:
    """The default policy with two api tenants added."""
    text, found = re.subn(
        r"^tenants:.*\n", POLICY_TENANTS, DEFAULT_POLICY_PATH.read_text(), count=1, flags=re.M
    )
    if not found:  # every request would get 401: say so rather than report 100 % failed
        raise SystemExit(f"no 'tenants:' line in {DEFAULT_POLICY_PATH}")
    path = folder / "policy.yaml"
    path.write_text(text)
    return path


async def drive(stack: Stack, args: argparse.Namespace, outcomes: list[Outcome]) -> float:
    """The load, with the outage in the middle; returns when the outage began (loop time)."""
    loop = asyncio.get_running_loop()
    body = {
        "model": "sim-llama-8b",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
    }
    end = loop.time() + args.duration
    services = stack.services
    assert services is not None and services.redis is not None
    redis_port = services.redis_port
    assert redis_port is not None
    async with aiohttp.ClientSession() as session:

        async def client(tenant: str) -> None:
            headers = {"authorization": f"Bearer sk-{tenant}"}
            while loop.time() < end:
                started = loop.time()
                url = f"{stack.url}/v1/chat/completions"
                async with session.post(url, json=body, headers=headers) as response:
                    await response.read()
                outcomes.append(Outcome(tenant, started, loop.time(), response.status))

        clients = [client("heavy") for _ in range(args.heavy)] + [client("light")]
        load = asyncio.gather(*clients)
        await asyncio.sleep(args.outage_at)
        began = loop.time()
        services.redis.popen.kill()
        services.redis.popen.wait()
        await asyncio.sleep(args.outage)
        with ProcessGroup(Path(tempfile.mkdtemp(prefix="fairlane-redis-"))) as group:
            start_redis(group, redis_port)
            await load
    return began


def window(outcomes: list[Outcome], start: float, end: float) -> dict[str, Any]:
    """What finished in [start, end): counts, failures, light latency, shares, Jain."""
    inside = [o for o in outcomes if start <= o.finished < end]
    ok = [o for o in inside if o.status == 200]
    light = sorted(o.finished - o.started for o in ok if o.tenant == "light")
    served = {t: sum(1 for o in ok if o.tenant == t) for t in ("heavy", "light")}
    total = sum(served.values()) or 1
    return {
        "seconds": round(end - start, 1),
        "requests": len(inside),
        "failed": len(inside) - len(ok),
        "light_p50_s": round(statistics.median(light), 3) if light else None,
        "light_p95_s": round(light[int(0.95 * (len(light) - 1))], 3) if light else None,
        "share": {t: round(n / total, 3) for t, n in served.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--outage-at", type=float, default=15.0)
    parser.add_argument("--outage", type=float, default=10.0)
    parser.add_argument("--heavy", type=int, default=16, help="heavy's outstanding requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fairlane-outage-"))
    outcomes: list[Outcome] = []
    with ProcessGroup(folder / "logs") as group:
        config = StackConfig(
            port=free_port(),
            policy_path=write_policy(folder),
            replicas=3,
            sim_args=("--scheduling-policy", "priority", "--max-num-seqs", "4"),
        )
        stack = Stack(config, group).start()
        started = time.monotonic()
        began = asyncio.run(drive(stack, args, outcomes))
    first = min(o.started for o in outcomes)
    windows = {
        "before": window(outcomes, first, began),
        "during": window(outcomes, began, began + args.outage),
        "after": window(outcomes, began + args.outage, max(o.finished for o in outcomes) + 1),
    }
    report = {
        "replicas": 3,
        "outage_s": args.outage,
        "wall_s": round(time.monotonic() - started, 1),
        "failed": sum(1 for o in outcomes if o.status != 200),
        "requests": len(outcomes),
        "windows": windows,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
