import asyncio

import pytest

from extproc.queues import DrainMeter, QueueFull, TierQueues, Waiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def waiter(request_id: str, tier: str, rank: int, loop: asyncio.AbstractEventLoop) -> Waiter:
    return Waiter(request_id, tier, rank, 0.0, loop.create_future())


async def test_pop_serves_most_urgent_tier_first_then_fifo() -> None:
    loop = asyncio.get_running_loop()
    queues = TierQueues()
    queues.push(waiter("b1", "batch", 2, loop), limit=10)
    queues.push(waiter("i1", "interactive", 0, loop), limit=10)
    queues.push(waiter("b2", "batch", 2, loop), limit=10)
    queues.push(waiter("i2", "interactive", 0, loop), limit=10)
    order = [queues.pop().request_id for _ in range(4)]  # type: ignore[union-attr]
    assert order == ["i1", "i2", "b1", "b2"]
    assert queues.pop() is None


async def test_full_tier_refuses_with_retry_after() -> None:
    loop = asyncio.get_running_loop()
    queues = TierQueues()
    queues.push(waiter("a", "api", 1, loop), limit=1)
    with pytest.raises(QueueFull) as info:
        queues.push(waiter("b", "api", 1, loop), limit=1)
    assert info.value.retry_after_s >= 1
    # other tiers are unaffected
    queues.push(waiter("c", "batch", 2, loop), limit=1)
    assert queues.depths() == {"api": 1, "batch": 1}


async def test_remove_takes_a_waiter_out_in_place() -> None:
    loop = asyncio.get_running_loop()
    queues = TierQueues()
    first, second = waiter("a", "api", 1, loop), waiter("b", "api", 1, loop)
    queues.push(first, limit=5)
    queues.push(second, limit=5)
    assert queues.remove(first)
    assert not queues.remove(first)
    assert not queues.contains("a") and queues.contains("b")
    assert queues.pop() is second


async def test_reranked_tier_changes_pop_order() -> None:
    loop = asyncio.get_running_loop()
    queues = TierQueues()
    queues.push(waiter("x", "x", 0, loop), limit=5)
    queues.push(waiter("y", "y", 1, loop), limit=5)
    queues.push(waiter("y2", "y", -1, loop), limit=5)  # policy reload made "y" most urgent
    assert queues.pop().request_id == "y"  # type: ignore[union-attr]


def test_drain_meter_rate_and_retry_after_follow_dequeues() -> None:
    clock = FakeClock()
    meter = DrainMeter(window_s=10.0, clock=clock)
    assert meter.rate() == 0
    for _ in range(20):
        meter.record()
    assert meter.rate() == pytest.approx(2.0)
    clock.now += 11
    assert meter.rate() == 0


async def test_retry_after_is_depth_over_drain_rate() -> None:
    loop = asyncio.get_running_loop()
    clock = FakeClock()
    queues = TierQueues(clock)
    for i in range(31):
        queues.push(waiter(f"r{i}", "api", 1, loop), limit=100)
    for _ in range(30):  # 30 dequeues in the 30 s window: 1/s
        queues.pop()
    for i in range(9):
        queues.push(waiter(f"s{i}", "api", 1, loop), limit=100)
    assert queues.retry_after_s("api") == 10  # 10 waiting at 1/s
