"""The gateway's real Prometheus exposition, with a sample in every family.

Dashboards and alert rules are checked against the names the service actually exports, not a
hand-kept list: this drives one request of every outcome through the real ``Gateway``
(admitted and completed, shed, rejected, an internal error, a failover pick, a good and a
bad policy reload) and renders the real ``GatewayCollector``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.core.blockhash import BlockHasher
from extproc.core.decisions import Forward, Respond
from extproc.core.events import Completion
from extproc.core.peers import PeerView, ReplicaReport
from extproc.core.prefix import EngineHashing
from extproc.core.prompt import BuiltinTokenizer
from extproc.fleet.discovery import DnsBackendSpec
from extproc.fleet.kv_events import KVBlockIndex
from extproc.fleet.kv_subscriber import KVEventSubscriber
from extproc.fleet.membership import Membership
from extproc.policy import DEFAULT_POLICY_PATH, Budget
from extproc.state.exchange import RedisExchange
from extproc.state.replica import SharedState
from extproc.transport.kv_feeds import KVEventFeeds
from extproc.transport.prometheus import GatewayCollector
from tests.extproc.factories import make_gateway, request

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""(sample name, its labels) -> value, as Prometheus would read an exposition."""


def parse_samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gateway_exposition() -> str:
    """``/metrics`` text of a gateway that has seen every kind of outcome."""
    return _drive()


def _drive() -> str:
    with tempfile.TemporaryDirectory() as folder:
        policy_file = Path(folder) / "policy.yaml"
        shutil.copy(DEFAULT_POLICY_PATH, policy_file)
        gateway = make_gateway(limit=2, policy_path=policy_file)
        store = gateway.policies
        local, remote = gateway.admission.pool.backends

        admitted = gateway.handle(request("sk-chat-demo", request_id="chat-1")).answer
        assert isinstance(admitted, Forward), admitted
        gateway.completed(Completion("chat-1", 200, local.address, 0.8, 2_000, ttfb_s=0.05))

        refused = gateway.handle(request("sk-wrong", request_id="bad-key")).answer
        assert isinstance(refused, Respond) and refused.status == 401, refused

        # A bug in the request path (simulated: admission raising) costs one request a 500,
        # counted as internal_error, through the gateway's real guard.
        def bug(*_: object) -> None:
            raise RuntimeError("simulated bug")

        submit = gateway.admission.submit
        gateway.admission.submit = bug  # type: ignore[assignment,method-assign]
        broken = gateway.handle(request("sk-chat-demo", request_id="bug-1")).answer
        gateway.admission.submit = submit  # type: ignore[method-assign]
        assert isinstance(broken, Respond) and broken.status == 500, broken

        local.healthy = False  # the local region is down: the next pick fails over
        failover = gateway.handle(request("sk-api-demo", request_id="api-1")).answer
        assert isinstance(failover, Forward) and failover.endpoints[0] == remote.address
        local.healthy = True

        tiers = tuple(
            dataclasses.replace(t, queue_limit=0) if t.name == "batch" else t
            for t in store.current.tiers
        )
        gateway.admission.configure(dataclasses.replace(store.current, tiers=tiers))
        shed = gateway.handle(request("sk-batch-demo", request_id="batch-1")).answer
        assert isinstance(shed, Respond) and shed.status == 429, shed

        policy_file.write_text(policy_file.read_text().replace("priority: 20", "priority: 21"))
        _bump_mtime(policy_file)
        assert store.reload()
        policy_file.write_text("tiers: [\n")
        _bump_mtime(policy_file)
        assert not store.reload()

        # A tenant with a budget: one request admitted, the next refused (429).
        spent = dataclasses.replace(
            store.current,
            tenants=tuple(
                dataclasses.replace(t, budget=Budget(requests_per_minute=1))
                if t.name == "chat-app"
                else t
                for t in store.current.tenants
            ),
        )
        store.current = spent
        gateway.admission.configure(spent)
        within = gateway.handle(request("sk-chat-demo", request_id="budget-1")).answer
        assert isinstance(within, Forward), within
        over = gateway.handle(request("sk-chat-demo", request_id="budget-2")).answer
        assert isinstance(over, Respond) and over.status == 429, over

        # As one of two replicas (never connected: the exchange is not run, its view is
        # applied by hand), so the shared-state families are exported too.
        def apply(view: PeerView, charges: list[tuple[str, str, float]]) -> None:
            gateway.admission.apply_peers(view)

        state = SharedState(gateway.admission, RedisExchange("redis://127.0.0.1:1/0", "r1"), apply)
        state.apply(PeerView.merge([ReplicaReport("r2", {local.address: {0: 1}})], 0.0), [])
        state.shared, state.replicas_seen = True, 2

        # A dns:// backend: one address joined (warming), one resolution failed.
        name = DnsBackendSpec("vllm.test", 8000, local.region)
        membership = Membership(gateway.admission.pool, (name,))
        membership.update(name, {"10.9.0.1"}, 0.0)
        membership.failed(name, "no answer in time")

        # The local engine publishes KV events (never connected: its subscriber is not
        # started), so the KV event families are exported too.
        local.kv_index = KVBlockIndex()
        local.kv_index.live = True
        feeds = KVEventFeeds(gateway.admission.pool)
        feeds.subscribers[local.address] = KVEventSubscriber("tcp://127.0.0.1:1", local.kv_index)
        # Precise matching with a tokenizer (the simulator's), so its families are too.
        gateway.admission.engine = EngineHashing(BuiltinTokenizer(), BlockHasher())

        registry = CollectorRegistry(auto_describe=False)
        registry.register(
            GatewayCollector(
                gateway.admission,
                gateway.stats,
                store,
                gateway.overload,
                state,
                membership,
                feeds,
            )
        )
        return generate_latest(registry).decode()


def _bump_mtime(path: Path) -> None:
    """A rewrite within the filesystem's timestamp granularity must still count as a change."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
