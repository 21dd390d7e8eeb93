"""What listens where: Envoy's admin, the service's gRPC port and its metrics stay on
loopback unless ``--bind`` (``fairlane up``) or ``--host`` (``fairlane serve``) says
otherwise; the client listener's TLS flags reach the stack."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.params import EnvoyParams
from extproc.ops import up
from extproc.ops.processes import ProcessGroup
from extproc.transport import server


def _parse(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def test_everything_internal_is_on_loopback_by_default() -> None:
    assert _parse(up, []).bind == "127.0.0.1"
    assert _parse(server, ["--backend", "10.0.0.1:8000"]).host == "127.0.0.1"
    assert render_bootstrap(EnvoyParams())["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }


def test_up_binds_the_service_only_where_told(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    loopback = up.Stack(up.StackConfig(service_args=("--state-period-ms", "5")), group)
    assert loopback._service_args() == ("--state-period-ms", "5")  # serve's own default
    everywhere = up.Stack(up.StackConfig(bind_host="0.0.0.0"), group)
    assert everywhere._service_args() == ("--host", "0.0.0.0")
    with pytest.raises(SystemExit):
        _parse(up, ["--bind", "10.0.0.7"])  # Envoy and up reach the service on loopback


def test_up_takes_tls_files_and_region_keys(tmp_path: Path) -> None:
    args = _parse(
        up, ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--region-key", "a=env:VLLM_KEY"]
    )
    assert (args.tls_cert, args.tls_key) == (Path("c.pem"), Path("k.pem"))
    assert args.region_key == ["a=env:VLLM_KEY"]
    assert up.Stack(up.StackConfig(tls_cert=Path("c.pem")), ProcessGroup(tmp_path)).url.startswith(
        "https://"
    )
