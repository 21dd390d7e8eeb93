"""Requests go only to engines that serve their model; the gateway answers for the rest."""

from __future__ import annotations

import dataclasses
import json

import pytest

from extproc.core.decisions import Forward, Hold, Respond
from extproc.core.events import RequestInfo
from extproc.core.gateway import Gateway
from extproc.fleet.backend import BackendPool, BackendSpec, backend_argument, parse_backend
from extproc.fleet.models import ModelsError, ServedModels
from extproc.fleet.vllm_metrics import LoraSlots
from extproc.policy import DEFAULT_POLICY_PATH, parse_policy
from tests.extproc.factories import make_gateway, request

LLAMA = ServedModels(frozenset({"llama-70b", "llama"}))
QWEN = ServedModels(frozenset({"qwen-7b"}), {"qwen-sql": "qwen-7b"})


def two_pools(limit: int = 4) -> Gateway:
    """Two idle backends: the first serves llama-70b (alias llama), the second qwen-7b with
    the adapter qwen-sql."""
    gateway = make_gateway(limit=limit)
    pool = gateway.admission.pool
    first, second = pool.backends
    pool.set_models(first, LLAMA)
    pool.set_models(second, QWEN)
    return gateway


def chat(model: object, request_id: str = "rid-1", key: str = "sk-chat-demo") -> RequestInfo:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hello"}]}
    if model is not None:
        body["model"] = model
    return request(key=key, body=body, request_id=request_id)


def error_of(decision: object) -> tuple[int, dict[str, object]]:
    assert isinstance(decision, Respond), decision
    return decision.status, json.loads(decision.body)["error"]


def test_parse_reads_bases_and_adapters_as_vllm_lists_them() -> None:
    document = {
        "object": "list",
        "data": [
            {"id": "tiny", "object": "model", "root": "/m/tiny", "parent": None},
            {"id": "tiny-alias", "object": "model", "root": "/m/tiny", "parent": None},
            {"id": "ad1", "object": "model", "root": "/adapters/ad1", "parent": "tiny"},
        ],
    }
    served = ServedModels.parse(document)
    assert served.bases == {"tiny", "tiny-alias"}
    assert served.adapters == {"ad1": "tiny"}
    assert served.serves("ad1") and served.serves("tiny-alias") and not served.serves("x")


@pytest.mark.parametrize(
    "document",
    [
        [],
        {"data": "x"},
        {"data": [{"id": 7}]},
        {"data": [{"id": ""}]},
        {"data": [{"id": "a", "parent": 3}]},
        {"data": [{"id": "a" * 300}]},
    ],
)
def test_parse_refuses_what_is_not_a_model_list(document: object) -> None:
    with pytest.raises(ModelsError):
        ServedModels.parse(document)


@pytest.mark.parametrize(
    ("model", "backend"),
    [("llama-70b", 0), ("llama", 0), ("qwen-7b", 1), ("qwen-sql", 1)],
)
def test_each_request_goes_to_an_engine_that_serves_its_model(model: str, backend: int) -> None:
    gateway = two_pools()
    pool = gateway.admission.pool
    for i in range(6):  # more than one engine's seats' worth: never the other engine
        decision = gateway.handle(chat(model, request_id=f"r{i}")).answer
        if isinstance(decision, Hold):
            continue
        assert isinstance(decision, Forward), decision
        assert decision.endpoints == (pool.backends[backend].address,)  # no alternates either


def test_a_model_no_engine_serves_is_404_and_never_queued() -> None:
    gateway = two_pools()
    status, error = error_of(gateway.handle(chat("gpt-5")).answer)
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert gateway.admission.in_flight == 0 and not len(gateway.admission.scheduler)


def test_while_an_engines_models_are_unknown_any_model_may_go_there() -> None:
    gateway = make_gateway()  # nothing read yet: the fleet routes as it always did
    decision = gateway.handle(chat("anything")).answer
    assert isinstance(decision, Forward)
    assert len(decision.endpoints) == 2


def test_a_served_model_with_no_healthy_engine_waits_then_gets_a_503_with_retry_after() -> None:
    gateway = two_pools()
    pool = gateway.admission.pool
    pool.backends[1].healthy = False
    hold = gateway.handle(chat("qwen-7b")).answer
    assert isinstance(hold, Hold)
    status, error = error_of(gateway.give_up(hold).answer)
    assert (status, error["code"]) == (503, "model_unavailable")
    assert gateway.give_up(hold).answer is not None
    answer = gateway.give_up(hold).answer
    assert isinstance(answer, Respond) and answer.headers.get("retry-after") == "1"


def test_the_gateway_lists_the_live_fleets_models() -> None:
    gateway = two_pools()
    info = RequestInfo(
        "GET",
        "/v1/models",
        {":method": "GET", ":path": "/v1/models", "authorization": "Bearer sk-chat-demo"},
        b"",
        "rid-m",
    )
    answer = gateway.handle(info).answer
    assert isinstance(answer, Respond) and answer.status == 200
    listed = {card["id"]: card["parent"] for card in json.loads(answer.body)["data"]}
    assert listed == {"llama": None, "llama-70b": None, "qwen-7b": None, "qwen-sql": "qwen-7b"}
    gateway.admission.pool.backends[1].healthy = False
    answer = gateway.handle(info).answer
    assert isinstance(answer, Respond)
    assert {card["id"] for card in json.loads(answer.body)["data"]} == {"llama", "llama-70b"}


@pytest.mark.parametrize("model", [7, "", ["a"], "x" * 10_000])
def test_a_malformed_model_is_a_400_or_404_and_never_queued(model: object) -> None:
    gateway = two_pools()
    status, error = error_of(gateway.handle(chat(model)).answer)
    assert status in (400, 404)
    assert error["param"] == "model" or error["code"] == "model_not_found"
    assert gateway.admission.in_flight == 0 and not len(gateway.admission.scheduler)


def test_a_model_sent_twice_is_a_400() -> None:
    gateway = two_pools()
    raw = b'{"model": "llama", "model": "qwen-7b", "messages": [{"role": "user", "content": "x"}]}'
    info = request(body={})
    info = RequestInfo(info.method, info.path, info.headers, raw, info.request_id)
    status, _ = error_of(gateway.handle(info).answer)
    assert status == 400


def test_a_model_sent_twice_under_an_escaped_name_is_a_400() -> None:
    gateway = two_pools()
    raw = b'{"model": "llama", "mo\\u0064el": "qwen-7b", "messages": []}'
    info = request(body={})
    info = RequestInfo(info.method, info.path, info.headers, raw, info.request_id)
    status, error = error_of(gateway.handle(info).answer)
    assert (status, error["param"]) == (400, "model")


def test_an_alias_or_default_is_sent_as_the_served_name() -> None:
    gateway = two_pools()
    decision = gateway.handle(chat("llama")).answer
    assert isinstance(decision, Forward)
    assert json.loads(decision.body)["model"] == "llama"  # a served name: unchanged


def with_models_policy(gateway: Gateway, yaml_extra: str, tenant_fields: str = "") -> None:
    """The default policy plus a ``models:`` section and fields on the chat tenant."""
    text = DEFAULT_POLICY_PATH.read_text()
    if tenant_fields:
        text = text.replace("  - name: chat-app\n", f"  - name: chat-app\n{tenant_fields}", 1)
    policy = parse_policy(text + yaml_extra)
    gateway.policies.current = dataclasses.replace(
        policy, max_in_flight_per_backend=gateway.admission.policy.max_in_flight_per_backend
    )
    gateway.admission.configure(gateway.policies.current)


CANARY = """
models:
  aliases:
    chat-latest:
      - {model: llama-70b, weight: 90}
      - {model: qwen-7b, weight: 10}
"""


@pytest.mark.parametrize(
    ("draw", "served", "backend"), [(0.5, "llama-70b", 0), (0.95, "qwen-7b", 1)]
)
def test_a_canary_alias_is_rewritten_to_the_target_its_draw_picks(
    draw: float, served: str, backend: int
) -> None:
    gateway = two_pools()
    gateway._draw = lambda: draw
    with_models_policy(gateway, CANARY)
    decision = gateway.handle(chat("chat-latest")).answer
    assert isinstance(decision, Forward)
    assert json.loads(decision.body)["model"] == served
    assert decision.endpoints[0] == gateway.admission.pool.backends[backend].address


def test_a_tenant_gets_its_default_model_and_only_the_models_it_may_use() -> None:
    gateway = two_pools()
    with_models_policy(gateway, "", "    models: ['llama*']\n    default_model: llama\n")
    decision = gateway.handle(chat(None)).answer
    assert isinstance(decision, Forward) and json.loads(decision.body)["model"] == "llama"
    status, error = error_of(gateway.handle(chat("qwen-7b")).answer)  # served, not allowed
    assert (status, error["code"]) == (404, "model_not_found")
    info = RequestInfo(
        "GET", "/v1/models", {":method": "GET", "authorization": "Bearer sk-chat-demo"}, b"", "m"
    )
    answer = gateway.handle(info).answer
    assert isinstance(answer, Respond)
    assert {c["id"] for c in json.loads(answer.body)["data"]} == {"llama", "llama-70b"}


def test_no_model_on_a_fleet_of_several_is_a_400_and_on_one_model_goes_as_it_is() -> None:
    gateway = two_pools()
    status, error = error_of(gateway.handle(chat(None)).answer)
    assert (status, error["code"]) == (400, "model_required")
    one = make_gateway()
    for backend in one.admission.pool.backends:
        one.admission.pool.set_models(backend, LLAMA)
    assert isinstance(one.handle(chat(None)).answer, Forward)


def test_a_pool_full_of_one_models_batch_never_holds_back_another_models_batch() -> None:
    gateway = two_pools(limit=2)
    held = []
    for i in range(6):  # batch takes a free seat, one a scrape: the rest wait for qwen
        answer = gateway.handle(chat("qwen-7b", request_id=f"q{i}", key="sk-batch-demo")).answer
        if isinstance(answer, Hold):
            held.append(answer)
    assert len(held) == 5
    decision = gateway.handle(chat("llama", request_id="l1", key="sk-batch-demo")).answer
    assert isinstance(decision, Forward)  # not behind the qwen requests of its tier
    assert decision.endpoints == (gateway.admission.pool.backends[0].address,)
    depths = gateway.admission.scheduler.depths()
    assert depths["batch@qwen-7b"] == 5 and sum(depths.values()) == 5


def test_an_adapter_goes_where_it_runs_then_where_a_slot_is_free() -> None:
    gateway = make_gateway()
    pool = gateway.admission.pool
    first, second = pool.backends
    adapters = ServedModels(frozenset({"qwen-7b"}), {"qwen-sql": "qwen-7b", "qwen-law": "qwen-7b"})
    for backend in (first, second):
        pool.set_models(backend, adapters)
    busy = LoraSlots(1, frozenset({"qwen-law"}), frozenset())
    running = LoraSlots(1, frozenset({"qwen-sql"}), frozenset())
    assert first.metrics is not None and second.metrics is not None
    first.metrics = dataclasses.replace(first.metrics, lora=busy)  # would have to swap
    second.metrics = dataclasses.replace(second.metrics, lora=running)
    decision = gateway.handle(chat("qwen-sql")).answer
    assert isinstance(decision, Forward) and decision.endpoints[0] == second.address
    first.metrics = dataclasses.replace(first.metrics, lora=LoraSlots(2, frozenset(), frozenset()))
    second.metrics = dataclasses.replace(second.metrics, lora=busy)
    decision = gateway.handle(chat("qwen-sql", request_id="r2")).answer
    assert isinstance(decision, Forward) and decision.endpoints[0] == first.address


def test_declared_models_route_until_the_engine_says_otherwise() -> None:
    spec = parse_backend("region-a=http://127.0.0.1:8101#seats=4,models=qwen-7b|qwen")
    assert spec.models == ("qwen-7b", "qwen")
    assert backend_argument(spec) == "region-a=http://127.0.0.1:8101#seats=4,models=qwen-7b|qwen"
    pool = BackendPool([spec, BackendSpec("127.0.0.1", 8102, "region-a")])
    declared, other = pool.backends
    assert pool.serving("qwen") == [declared, other]  # the other's models are not known
    pool.set_models(other, LLAMA)
    assert pool.serving("qwen") == [declared] and pool.pool_of("qwen") == "qwen"
    pool.set_models(declared, QWEN)  # its /v1/models, read: it wins
    assert pool.serving("qwen") == [] and pool.serving("qwen-sql") == [declared]


@pytest.mark.parametrize("bad", ["models=", "models=a||b", "models=" + "x" * 300])
def test_a_malformed_models_option_names_what_is_wrong(bad: str) -> None:
    with pytest.raises(ValueError, match="models must be names separated by"):
        parse_backend(f"http://127.0.0.1:8101#{bad}")


def test_an_engine_joining_a_fleet_of_known_models_takes_nothing_until_its_own_are_read() -> None:
    gateway = two_pools()
    pool = gateway.admission.pool
    joined = pool.add(BackendSpec("127.0.0.1", 8103, "a"))
    assert joined.models_expected
    assert joined not in pool.serving("llama") and joined not in pool.serving("qwen-7b")
    pool.set_models(joined, QWEN)
    assert joined in pool.serving("qwen-7b") and joined not in pool.serving("llama")


RUNTIME_ADAPTER = """
models:
  adapters:
    qwen-med: {base: qwen-7b, path: /adapters/qwen-med}
"""


def with_runtime_adapter() -> Gateway:
    """Two pools whose qwen engine may load ``qwen-med`` at run time, with a free slot."""
    gateway = two_pools()
    with_models_policy(gateway, RUNTIME_ADAPTER)
    qwen = gateway.admission.pool.backends[1]
    assert qwen.metrics is not None
    qwen.metrics = dataclasses.replace(qwen.metrics, lora=LoraSlots(2, frozenset(), frozenset()))
    return gateway


def test_a_runtime_adapter_goes_to_an_engine_of_its_base_which_loads_it_first() -> None:
    gateway = with_runtime_adapter()
    qwen = gateway.admission.pool.backends[1]
    decision = gateway.handle(chat("qwen-med")).answer
    assert isinstance(decision, Forward)
    assert decision.endpoints == (qwen.address,)
    assert decision.load is not None
    assert (decision.load.address, decision.load.name, decision.load.base, decision.load.path) == (
        qwen.address,
        "qwen-med",
        "qwen-7b",
        "/adapters/qwen-med",
    )
    assert json.loads(decision.body)["model"] == "qwen-med"


def test_an_engine_that_holds_the_runtime_adapter_needs_no_load() -> None:
    gateway = with_runtime_adapter()
    pool = gateway.admission.pool
    pool.set_models(pool.backends[1], ServedModels(QWEN.bases, {"qwen-med": "qwen-7b"}))
    decision = gateway.handle(chat("qwen-med")).answer
    assert isinstance(decision, Forward) and decision.load is None


def test_runtime_adapters_are_opt_in_and_listed_only_where_their_base_is_served() -> None:
    gateway = two_pools()  # no models.adapters: an adapter no engine lists is unknown
    status, error = error_of(gateway.handle(chat("qwen-med")).answer)
    assert (status, error["code"]) == (404, "model_not_found")
    gateway = with_runtime_adapter()
    info = RequestInfo(
        "GET", "/v1/models", {":method": "GET", "authorization": "Bearer sk-chat-demo"}, b"", "m"
    )
    answer = gateway.handle(info).answer
    assert isinstance(answer, Respond)
    listed = {c["id"]: c["parent"] for c in json.loads(answer.body)["data"]}
    assert listed["qwen-med"] == "qwen-7b"
    gateway.admission.pool.backends[1].healthy = False  # its base's engine is gone
    answer = gateway.handle(info).answer
    assert isinstance(answer, Respond)
    assert "qwen-med" not in {c["id"] for c in json.loads(answer.body)["data"]}


def test_an_engine_whose_load_failed_takes_no_load_until_it_may_retry() -> None:
    gateway = with_runtime_adapter()
    pool = gateway.admission.pool
    qwen = pool.backends[1]
    qwen.no_loads_until = pool.clock() + 60
    hold = gateway.handle(chat("qwen-med")).answer
    assert isinstance(hold, Hold)  # waits: no engine may load it now
    status, error = error_of(gateway.give_up(hold).answer)
    assert (status, error["code"]) == (503, "model_unavailable")
    qwen.no_loads_until = pool.clock()
    decision = gateway.handle(chat("qwen-med", request_id="r2")).answer
    assert isinstance(decision, Forward) and decision.load is not None


def test_a_failed_load_is_a_503_with_retry_after_that_names_the_adapter() -> None:
    gateway = with_runtime_adapter()
    decision = gateway.handle(chat("qwen-med")).answer
    assert isinstance(decision, Forward) and decision.load is not None
    answer = gateway.adapter_unavailable(decision.load, "interactive", "HTTP 404: Not Found")
    status, error = error_of(answer)
    assert (status, error["code"]) == (503, "adapter_unavailable")
    assert "qwen-med" in str(error["message"]) and answer.headers["retry-after"] == "1"


def test_alternates_that_would_need_a_load_of_their_own_are_left_out() -> None:
    gateway = make_gateway()
    pool = gateway.admission.pool
    for backend in pool.backends:
        pool.set_models(backend, QWEN)
        assert backend.metrics is not None
        backend.metrics = dataclasses.replace(
            backend.metrics, lora=LoraSlots(2, frozenset(), frozenset())
        )
    with_models_policy(gateway, RUNTIME_ADAPTER)
    decision = gateway.handle(chat("qwen-med")).answer
    assert isinstance(decision, Forward) and decision.load is not None
    assert decision.endpoints == (decision.load.address,)
    holder = next(b for b in pool.backends if b.address != decision.load.address)
    pool.set_models(holder, ServedModels(QWEN.bases, {**QWEN.adapters, "qwen-med": "qwen-7b"}))
    # the engine holding it wins over one that would load it
    decision = gateway.handle(chat("qwen-med", request_id="r2")).answer
    assert isinstance(decision, Forward) and decision.load is None
    assert decision.endpoints[0] == holder.address


def test_a_full_dispatch_lets_every_pool_go_the_most_urgent_first() -> None:
    gateway = two_pools(limit=2)
    admission = gateway.admission
    llama_engine, qwen_engine = admission.pool.backends
    llama_engine.healthy = qwen_engine.healthy = False
    for request_id, model, key in (
        ("batch-llama", "llama", "sk-batch-demo"),
        ("chat-qwen", "qwen-7b", "sk-chat-demo"),
    ):
        assert isinstance(gateway.handle(chat(model, request_id, key)).answer, Hold)
    llama_engine.healthy = qwen_engine.healthy = True
    grants = admission.dispatch()  # as after a scrape round: both pools gained room
    assert [g.request_id for g in grants] == ["chat-qwen", "batch-llama"]
    assert admission.backend_of("chat-qwen") is qwen_engine
    assert admission.backend_of("batch-llama") is llama_engine
