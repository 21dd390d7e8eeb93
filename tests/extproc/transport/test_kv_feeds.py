"""One KV event subscription per engine that publishes, following the pool
(extproc.transport.kv_feeds), against the simulator's publisher on loopback."""

from __future__ import annotations

from extproc.fleet.backend import BackendPool, BackendSpec, KVEventPorts
from extproc.fleet.vllm_metrics import EngineMetrics
from extproc.ops.processes import free_port
from extproc.transport.kv_feeds import KVEventFeeds, endpoints
from loadtests.sim.kv_events import block_stored
from loadtests.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from tests.polling import until


def publishing_spec(port: int) -> BackendSpec:
    return BackendSpec("127.0.0.1", port, "r", kv_events=KVEventPorts(free_port(), free_port()))


def publisher(spec: BackendSpec) -> KVEventPublisher:
    """The simulator's publisher on ``spec``'s ports, as ``fairlane sim`` binds them."""
    ports = spec.kv_events
    assert ports is not None
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{ports.port}",
        replay_endpoint=f"tcp://*:{ports.replay_port}",
    )
    return KVEventPublisher(config, bind_host="127.0.0.1")


def test_endpoints_are_on_the_engines_host() -> None:
    spec = BackendSpec("10.0.0.5", 8000, "r", kv_events=KVEventPorts(5557, 5558))
    pool = BackendPool([spec, BackendSpec("::1", 8000, "r", kv_events=KVEventPorts(5557))])
    first, second = pool.backends
    assert endpoints(first) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert endpoints(second) == ("tcp://[::1]:5557", None)
    assert endpoints(BackendPool([BackendSpec("10.0.0.6", 8000)]).backends[0]) is None


async def test_subscriptions_follow_the_pool_and_fill_each_engines_index() -> None:
    events, quiet = publishing_spec(free_port()), BackendSpec("127.0.0.1", free_port(), "r")
    pool = BackendPool([events, quiet])
    feeds = KVEventFeeds(pool)
    pub = publisher(events)
    pub.start()
    try:
        await feeds.sync()
        assert list(feeds.subscribers) == [events.address]  # the quiet engine has none
        index = pool.by_address[events.address].kv_index
        assert index is not None
        await until(lambda: index.live, "the engine's stream followed from its start")
        pub.publish([block_stored([11, 12], None, list(range(32)), 16)])

        def arrived() -> bool:
            # PUB drops what it sends before the subscription reaches it; the next batch
            # then shows a gap, which the subscriber replays.
            if {11, 12} <= set(index.held):
                return True
            pub.publish([block_stored([99], None, list(range(16)), 16)])
            return False

        await until(arrived, "the engine's blocks in its index", every_s=0.1)

        joined = publishing_spec(free_port())
        pool.add(joined)
        metrics = EngineMetrics(0, 0, 0.0, 0.0, 0.0, pool.clock(), 16, 3000)
        pool.by_address[events.address].record_scrape(metrics, granted_before=0)
        await feeds.sync()
        assert set(feeds.subscribers) == {events.address, joined.address}
        assert feeds.subscribers[events.address].relive_after_blocks == 3000  # its KV size

        pool.remove(events.address)
        await feeds.sync()
        assert list(feeds.subscribers) == [joined.address]
    finally:
        await feeds.stop()
        await pub.close()
    assert feeds.subscribers == {}
