"""Each peer arm for real: its gateway in front of two simulated engines, a request through
it, and every process stopped afterwards.

The peers come from ``scripts/setup-peers`` (which ``scripts/test`` runs). One that is not
installed FAILS this test with the reason and the install command: a peer that silently
skips would leave the bench's comparison untested.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from extproc.ops.processes import ProcessGroup
from loadtests.bench.arms import start_arm
from loadtests.bench.cachestats import parse_prefix_counters
from loadtests.bench.peers.install import missing_reason
from loadtests.bench.peers.kinds import PEER_ARMS
from loadtests.bench.request_style import request_style
from loadtests.bench.scenario import SCENARIO_DIR, Scenario, parse_scenario
from loadtests.bench.scenario.model import PEER_KINDS
from tests.pids import alive

pytestmark = pytest.mark.integration

POLICY = SCENARIO_DIR / "policies" / "bench-x20.yaml"
# ~200 words of system prompt: a dozen full 16-token blocks, shared by both requests
SYSTEM = " ".join(f"word{i % 97}" for i in range(200))


def scenario(tmp_path: Path, log: Path) -> Scenario:
    data: dict[str, Any] = {
        "name": "peers-e2e",
        "duration_s": 10,
        "speedup": 20,
        "policy": str(POLICY),
        "backends": {"count": 2, "profile": "llama-8b-l4", "flags": ["--log-requests", str(log)]},
        "groups": [
            {
                "name": "batch",
                "api_key": "sk-batch-demo",
                "tenant": "nightly-batch",
                "tier": "batch",
                "rate": 1.0,
                "prompt_tokens": 32,
                "max_tokens": 4,
            }
        ],
        "arms": [{"name": "fifo", "kind": "fifo"}, {"name": "fairlane", "kind": "fairlane"}]
        + [{"name": kind, "kind": kind} for kind in PEER_KINDS],
    }
    return parse_scenario(data, tmp_path / "peers-e2e.yaml")


def post(url: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def prefix_hits(backend_urls: tuple[str, ...]) -> float:
    total = 0.0
    for url in backend_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            counters = parse_prefix_counters(response.read().decode())
        total += counters.hits
    return total


@pytest.mark.parametrize("kind", PEER_KINDS)
def test_a_peer_arm_serves_through_its_gateway_and_stops(kind: str, tmp_path: Path) -> None:
    reason = missing_reason(PEER_ARMS[kind].peer)
    if reason is not None:
        pytest.fail(reason, pytrace=False)
    log = tmp_path / "requests.jsonl"
    sc = scenario(tmp_path, log)
    style = request_style(kind, POLICY)
    with ProcessGroup(tmp_path / "logs") as group:
        running = start_arm(sc, sc.arm(kind), group)
        assert PEER_ARMS[kind].peer.name in running.pids
        for turn in range(2):  # the same conversation twice: its prefix is cached after one
            body = {
                "model": sc.model,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"question {turn}"},
                ],
                "max_tokens": 3,
                "ignore_eos": True,
                **style.extras("batch"),
            }
            answer = post(running.url, body, style.key("sk-batch-demo"))
            assert answer["usage"]["completion_tokens"] == 3
        if PEER_ARMS[kind].router_policy in ("cache_aware", "kv_aware"):
            # the second request went where the first one's blocks are (an engine counts a
            # hit when it schedules the request, before it answers)
            assert prefix_hits(running.backend_urls) > 0
    received = [json.loads(line) for line in log.read_text().splitlines()]
    turns = [r for r in received if r["max_tokens"] == 3]
    assert len(turns) == 2
    # what reached the engines: a priority only where the arm passes vLLM's on
    expected = 20 if PEER_ARMS[kind].priority == "extra_body" else None
    assert [r["body_priority"] for r in turns] == [expected, expected]
    for name, pid in running.pids.items():
        assert not alive(pid), f"{kind}: {name} (pid {pid}) still running"
