"""The FIFO baseline bootstrap of ``fairlane bench``: Envoy accepts it, and it has no fairlane.

The baseline must differ from the gateway only in what fairlane adds (ext_proc, override_host
routing, the completion feed); everything else comes from the same builders.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from extproc.envoy.binary import validate
from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.clusters import backend_cluster
from extproc.envoy.params import EnvoyParams
from extproc.fleet.backend import BackendSpec
from loadtests.bench.fifo_bootstrap import render_fifo_bootstrap

BACKENDS = (
    BackendSpec("127.0.0.1", 18101, "region-a"),
    BackendSpec("127.0.0.1", 18102, "region-a"),
    BackendSpec("127.0.0.1", 18103, "region-b"),
)


def test_envoy_validates_the_fifo_bootstrap(tmp_path: Path) -> None:
    params = EnvoyParams(listen_port=18080, admin_port=18081, backends=BACKENDS)
    path = tmp_path / "fifo.yaml"
    path.write_text(yaml.safe_dump(render_fifo_bootstrap(params), sort_keys=False))
    validate(path)  # raises with Envoy's message if refused


def test_fifo_has_no_ext_proc_and_round_robins_over_every_backend() -> None:
    params = EnvoyParams(backends=BACKENDS, access_log_path="/tmp/fifo-access.log")
    config = render_fifo_bootstrap(params)
    text = json.dumps(config)
    assert "ext_proc" not in text
    assert "override_host" not in text
    assert "http_grpc" not in text  # no completion feed: no service to send it to
    (cluster,) = config["static_resources"]["clusters"]
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.round_robin"
    (locality,) = cluster["load_assignment"]["endpoints"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in locality["lb_endpoints"]
    ]
    assert ports == [18101, 18102, 18103]
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == cluster["name"]
    assert route["timeout"] == "0s"
    assert hcm["access_log"][0]["name"] == "envoy.access_loggers.file"


def test_fifo_shares_the_gateway_limits() -> None:
    """Same buffer limits, circuit breakers, health checks and connection cap as fairlane."""
    params = EnvoyParams(backends=BACKENDS, max_body_bytes=1024 * 1024)
    fifo = render_fifo_bootstrap(params)
    gateway = render_bootstrap(params)
    (cluster,) = fifo["static_resources"]["clusters"]
    reference = backend_cluster(params)
    for key in ("circuit_breakers", "health_checks", "per_connection_buffer_limit_bytes"):
        assert cluster[key] == reference[key]
    assert fifo["overload_manager"] == gateway["overload_manager"]
    assert (
        fifo["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"]
        == params.buffer_limit_bytes
    )
