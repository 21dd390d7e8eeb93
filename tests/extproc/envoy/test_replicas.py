"""Several service replicas in the Envoy config: failover between them, a completion feed to
each, checked on the rendered dicts and by the real Envoy (``--mode validate``).

One replica must render exactly as before (no health checks, the feed on the ext_proc
cluster), whether it is named by ``extproc_host``/``extproc_port`` or listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy.binary import validate
from extproc.envoy.bootstrap import render_bootstrap, render_yaml
from extproc.envoy.params import EnvoyConfigError, EnvoyParams, ServiceReplica
from extproc.envoy.render import typed_check
from extproc.envoy.replicas import (
    AFFINITY_HEADER,
    EJECT_AFTER_LOCAL_FAILURES,
    REPLICA_CLUSTER_PREFIX,
    STREAM_RETRY_ON,
    replica_cluster_name,
)
from extproc.envoy.snippet import render_mesh_snippet, wrap_snippet
from extproc.wire import COMPLETIONS_LOG, EXTPROC_CLUSTER
from tests.extproc.envoy.filters import ext_proc_of

THREE = (("127.0.0.1", 50061), ("127.0.0.1", 50062), ("fairlane-3", 50051))


def three() -> EnvoyParams:
    return EnvoyParams(extproc_replicas=THREE, max_held_requests=500)


def clusters(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def hosts(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    (group,) = cluster["load_assignment"]["endpoints"]
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in group["lb_endpoints"]
    ]


def hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    config: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return config


def grpc_loggers(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        log["typed_config"]["common_config"]
        for log in hcm(bootstrap)["access_log"]
        if log["name"] == "envoy.access_loggers.http_grpc"
    ]


def test_three_replicas_pass_envoys_validation_and_the_typed_check(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text(render_yaml(three()))
    validate(path)
    typed_check(render_bootstrap(three()))


def test_the_mesh_snippet_with_replicas_validates(tmp_path: Path) -> None:
    path = tmp_path / "snippet.yaml"
    path.write_text(yaml.safe_dump(wrap_snippet(render_mesh_snippet(three()))))
    validate(path)


def test_the_ext_proc_cluster_lists_every_replica_and_fails_over() -> None:
    extproc = clusters(render_bootstrap(three()))[EXTPROC_CLUSTER]
    assert hosts(extproc) == list(THREE)
    assert extproc["type"] == "STRICT_DNS"  # one of them is a name
    (check,) = extproc["health_checks"]
    assert "tcp_health_check" in check
    assert check["interval"] == check["no_traffic_interval"] == "1s"
    assert check["unhealthy_threshold"] == 1
    outlier = extproc["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] is True
    assert outlier["consecutive_local_origin_failure"] == EJECT_AFTER_LOCAL_FAILURES
    assert outlier["enforcing_consecutive_local_origin_failure"] == 100
    assert extproc["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}
    # retries of the stream count against the breaker: as many as streams may be open
    for threshold in extproc["circuit_breakers"]["thresholds"]:
        assert threshold["max_retries"] == threshold["max_requests"] == 500 + 1024


def test_all_ip_replicas_make_a_static_cluster() -> None:
    params = EnvoyParams(extproc_replicas=(("10.0.0.1", 50051), ("10.0.0.2", 50051)))
    assert clusters(render_bootstrap(params))[EXTPROC_CLUSTER]["type"] == "STATIC"


def test_each_replica_gets_every_completion_from_a_logger_of_its_own() -> None:
    bootstrap = render_bootstrap(three())
    by_name = clusters(bootstrap)
    loggers = grpc_loggers(bootstrap)
    assert len(loggers) == 3
    targets = [log["grpc_service"]["envoy_grpc"]["cluster_name"] for log in loggers]
    assert targets == [replica_cluster_name(i) for i in (1, 2, 3)]
    assert {log["log_name"] for log in loggers} == {COMPLETIONS_LOG}
    for target, replica in zip(targets, THREE, strict=True):
        assert hosts(by_name[target]) == [replica]  # that replica alone
        # gRPC: HTTP/2 to the replica, like the ext_proc cluster
        options = by_name[target]["typed_extension_protocol_options"]
        assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]
    assert by_name[targets[0]]["type"] == "STATIC"
    assert by_name[targets[2]]["type"] == "STRICT_DNS"
    assert sorted(n for n in by_name if n.startswith(REPLICA_CLUSTER_PREFIX)) == sorted(targets)


def test_a_stream_that_cannot_open_is_retried_on_another_replica() -> None:
    bootstrap = render_bootstrap(three())
    ext_proc = ext_proc_of(hcm(bootstrap))["typed_config"]
    retry = ext_proc["grpc_service"]["retry_policy"]
    assert retry["retry_on"] == STREAM_RETRY_ON
    assert "connect-failure" in retry["retry_on"].split(",")
    assert retry["num_retries"] == 2
    (predicate,) = retry["retry_host_predicate"]
    assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
    two = EnvoyParams(extproc_replicas=THREE[:2])
    filter_two = ext_proc_of(hcm(render_bootstrap(two)))["typed_config"]
    assert filter_two["grpc_service"]["retry_policy"]["num_retries"] == 1


def test_each_client_keys_streams_hash_to_one_replica() -> None:
    """Maglev over a header of the stream that the filter fills from the client's key,
    wherever the key is: moved by the shipped bootstrap, as sent, or in ``x-api-key``. The
    completion feeds (one replica each) hash nothing."""
    bootstrap = render_bootstrap(three())
    by_name = clusters(bootstrap)
    extproc = by_name[EXTPROC_CLUSTER]
    assert extproc["lb_policy"] == "MAGLEV"
    (options,) = extproc["typed_extension_protocol_options"].values()
    assert options["hash_policy"] == [{"header": {"header_name": AFFINITY_HEADER}}]
    ext_proc = ext_proc_of(hcm(bootstrap))["typed_config"]
    (metadata,) = ext_proc["grpc_service"]["initial_metadata"]
    assert metadata["key"] == AFFINITY_HEADER
    for header in ("x-fairlane-client-authorization", "authorization", "x-api-key"):
        assert header in metadata["value"]
    (feed_options,) = by_name[replica_cluster_name(1)]["typed_extension_protocol_options"].values()
    assert "hash_policy" not in feed_options and "lb_policy" not in by_name[replica_cluster_name(1)]


def test_the_runtime_layer_comes_from_the_replicas_and_reconnects_fast() -> None:
    (rtds, _) = render_bootstrap(three())["layered_runtime"]["layers"]
    source = rtds["rtds_layer"]["rtds_config"]["api_config_source"]
    (service,) = source["grpc_services"]
    assert service["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    assert service["envoy_grpc"]["retry_policy"]["retry_back_off"]["max_interval"] == "2s"


def test_one_listed_replica_renders_as_the_single_service() -> None:
    listed = EnvoyParams(extproc_replicas=(("127.0.0.1", 50051),))
    assert render_yaml(listed) == render_yaml(EnvoyParams())
    assert listed.service_replicas == (ServiceReplica("127.0.0.1", 50051),)
    assert not listed.replicated
    moved = EnvoyParams(extproc_replicas=(("10.9.9.9", 4000),))
    assert hosts(clusters(render_bootstrap(moved))[EXTPROC_CLUSTER]) == [("10.9.9.9", 4000)]


def test_one_service_has_no_failover_and_one_feed() -> None:
    bootstrap = render_bootstrap(EnvoyParams())
    extproc = clusters(bootstrap)[EXTPROC_CLUSTER]
    assert "health_checks" not in extproc and "outlier_detection" not in extproc
    (logger,) = grpc_loggers(bootstrap)
    assert logger["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    assert not [n for n in clusters(bootstrap) if n.startswith(REPLICA_CLUSTER_PREFIX)]
    ext_proc = ext_proc_of(hcm(bootstrap))["typed_config"]
    assert "retry_policy" not in ext_proc["grpc_service"]
    assert "initial_metadata" not in ext_proc["grpc_service"] and "lb_policy" not in extproc


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ((("a", 1), ("a", 1)), "listed twice"),
        ((("a", 0), ("b", 1)), "port"),
        ((("", 1), ("b", 1)), "needs a host"),
    ],
)
def test_bad_replicas_are_refused(replicas: tuple[tuple[str, int], ...], message: str) -> None:
    with pytest.raises(EnvoyConfigError, match=message):
        EnvoyParams(extproc_replicas=replicas)


def test_a_replica_address_brackets_ipv6() -> None:
    assert ServiceReplica("::1", 50051).address == "[::1]:50051"
    assert ServiceReplica("fairlane-1", 50051).address == "fairlane-1:50051"
