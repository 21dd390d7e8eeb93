"""The picker's scorers: each weighed by a field of the policy's routing, summed."""

from __future__ import annotations

import dataclasses

from extproc.core.scorers import LOAD_SCORERS, Context, weighted
from extproc.fleet.backend import BackendPool, BackendSpec
from extproc.policy import Routing
from tests.extproc.factories import FakeClock, scraped


def test_every_scorer_is_weighed_by_a_routing_field() -> None:
    fields = {f.name for f in dataclasses.fields(Routing)}
    assert {weight for weight, _ in LOAD_SCORERS} <= fields


def test_the_load_score_is_the_weighted_sum_and_a_zero_weight_drops_its_scorer() -> None:
    clock = FakeClock()
    pool = BackendPool([BackendSpec("127.0.0.1", 8101, "b", seats=4)], clock=clock)
    (backend,) = pool.backends
    scraped(backend, clock, waiting=2, kv=0.5)
    context = Context(slot_limit=4, local_region="a")
    routing = Routing(queue_weight=1.0, kv_cache_weight=2.0, region_weight=0.5)
    assert weighted(routing).score(backend, context) == 2 / 4 + 2 * 0.5 + 0.5
    no_kv = dataclasses.replace(routing, kv_cache_weight=0.0)
    assert len(weighted(no_kv).scorers) == len(weighted(routing).scorers) - 1
    assert weighted(no_kv).score(backend, context) == 2 / 4 + 0.5
