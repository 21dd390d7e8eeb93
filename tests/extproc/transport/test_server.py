"""The server's background work that has no socket: the policy file watch."""

import asyncio
from pathlib import Path

import pytest

from extproc.policy import PolicyStore
from extproc.transport.server import watch_policy
from tests.extproc.policy.test_policy import MINIMAL, rewrite


async def test_watch_picks_up_a_change(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(MINIMAL)
    store = PolicyStore(policy_file, poll_interval_s=0.01)
    swapped = asyncio.Event()
    store.on_change(lambda _: swapped.set())
    task = asyncio.create_task(watch_policy(store))
    try:
        rewrite(policy_file, MINIMAL.replace("queue_limit: 10", "queue_limit: 77"))
        await asyncio.wait_for(swapped.wait(), timeout=5)
        assert store.current.tier("fast").queue_limit == 77
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
