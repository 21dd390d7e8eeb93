"""A whole gateway (real Envoy, the service, simulated vLLM) on free loopback ports.

The stack is the one ``fairlane up`` runs, started with a small test policy so that queues
fill and deadlines pass within seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from extproc.ops.processes import ProcessGroup, free_port
from extproc.ops.up import Stack, StackConfig

DEMO_TENANTS = """\
tenants:
  - name: chat-app
    api_keys: [sk-chat-demo]
    tiers: [interactive]
  - name: code-review
    api_keys: [sk-api-demo]
    tiers: [api]
  - name: nightly-batch
    api_keys: [sk-batch-demo]
    tiers: [batch]
"""
"""The policies' three tenants, one per tier, with the shipped demo keys."""

# One backend that admits one request at a time: a single long request fills the fleet.
TEST_POLICY = f"""\
max_body_bytes: 65536
max_in_flight_per_backend: 1
on_escalation: downgrade
user_header: x-user-id
tiers:
  - name: interactive
    aliases: [high]
    priority: 0
    queue_limit: 4
    queue_deadline_s: 30
  - name: api
    aliases: [normal]
    priority: 10
    queue_limit: 1
    queue_deadline_s: 1.5
  - name: batch
    aliases: [low]
    priority: 20
    queue_limit: 8
    queue_deadline_s: 60
{DEMO_TENANTS}rules:
  - name: batch-endpoint
    match: {{path_prefix: /v1/batch/}}
    tier: batch
    strip_path_prefix: /v1/batch
    add_path_prefix: /v1
"""

# llama-8b-l4 takes ~55 ms per step: 60 tokens hold the only slot for ~3 s.
SIM_ARGS = ("--scheduling-policy", "priority", "--profile", "llama-8b-l4", "--model", "sim-model")
MODEL = "sim-model"


def start_stack(
    tmp: Path,
    policy_text: str = TEST_POLICY,
    *,
    sim_regions: tuple[str, ...] = ("region-a",),
    sim_args: tuple[str, ...] = SIM_ARGS,
    sim_extra_args: Mapping[int, tuple[str, ...]] | None = None,
    replicas: int = 1,
    service_args: tuple[str, ...] = (),
) -> tuple[ProcessGroup, Stack]:
    """A stack with the test policy and one simulator by default; the keyword arguments
    give several (``sim_regions``, the first region named is the local one), per-
    simulator flags (``sim_extra_args`` by index, e.g. fault injection), service
    replicas sharing a local Redis and extra ``fairlane serve`` flags."""
    policy = tmp / "policy.yaml"
    policy.write_text(policy_text)
    group = ProcessGroup(tmp / "logs")
    try:
        config = StackConfig(
            port=free_port(),
            policy_path=policy,
            sim_regions=sim_regions,
            sim_args=sim_args,
            sim_extra_args=dict(sim_extra_args or {}),
            sim_log_requests=True,
            replicas=replicas,
            service_args=service_args,
        )
        stack = Stack(config, group).start()
    except BaseException:
        group.stop()
        raise
    return group, stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    group, running = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield running
    finally:
        group.stop()


def backend_requests(stack: Stack) -> list[dict[str, Any]]:
    """Every request the (single) simulated backend received, oldest first."""
    (log,) = stack.request_logs.values()
    return read_request_log(log)


def read_request_log(log: Path) -> list[dict[str, Any]]:
    """Every request one simulator logged, oldest first (a line being written is skipped)."""
    if not log.exists():
        return []
    records = []
    for line in log.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def requests_by_backend(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    """Backend address -> every request its simulator logged, oldest first."""
    return {address: read_request_log(log) for address, log in stack.request_logs.items()}


def chat(content: str = "Hello there", max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
