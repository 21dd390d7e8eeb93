"""TLS on the client listener: rendered as Envoy's DownstreamTlsContext, both files or none,
and validated by Envoy even where the files live only in Envoy's container."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.deployment import parse_deployment
from extproc.envoy.params import EnvoyConfigError, EnvoyParams
from extproc.envoy.render import envoy_validate, render, tls_files_elsewhere, with_tls

DEPLOYMENT = "backends: [{url: http://10.0.0.11:8000}]\n"


def _chain(bootstrap: dict[str, Any]) -> dict[str, Any]:
    chain: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]
    return chain


def test_plain_http_without_files() -> None:
    assert "transport_socket" not in _chain(render_bootstrap(EnvoyParams()))


def test_a_certificate_and_key_make_a_downstream_tls_context() -> None:
    params = EnvoyParams(tls_cert_path="/tls/c.pem", tls_key_path="/tls/k.pem")
    socket = _chain(render_bootstrap(params))["transport_socket"]
    config = socket["typed_config"]
    assert config["@type"].endswith("tls.v3.DownstreamTlsContext")
    common = config["common_tls_context"]
    assert common["tls_certificates"] == [
        {"certificate_chain": {"filename": "/tls/c.pem"}, "private_key": {"filename": "/tls/k.pem"}}
    ]
    assert common["alpn_protocols"] == ["h2", "http/1.1"]


@pytest.mark.parametrize(
    ("cert", "key"), [("/c.pem", None), (None, "/k.pem"), ("", "/k.pem"), ("/c.pem", "")]
)
def test_both_files_or_neither(cert: str | None, key: str | None) -> None:
    with pytest.raises(EnvoyConfigError):
        EnvoyParams(tls_cert_path=cert, tls_key_path=key)


def test_render_flags_put_tls_on_the_deployments_listener(tmp_path: Path) -> None:
    deployment = parse_deployment(DEPLOYMENT, "d.yaml")
    assert with_tls(deployment, None, None) is deployment
    tls = with_tls(deployment, "c.pem", "k.pem").params
    assert tls.tls_cert_path is not None and tls.tls_cert_path.endswith("/c.pem")
    assert Path(tls.tls_cert_path).is_absolute()
    with pytest.raises(EnvoyConfigError, match="go together"):
        with_tls(deployment, "c.pem", None)


@pytest.mark.integration
def test_envoy_validates_tls_whether_or_not_the_files_are_here(tmp_path: Path) -> None:
    """The files exist only in Envoy's container: validated without the socket. They are
    here: Envoy loads them (a key that is no key is refused)."""
    deployment = parse_deployment(DEPLOYMENT, "d.yaml")
    elsewhere = render(with_tls(deployment, "/nonexistent/c.pem", "/nonexistent/k.pem"))
    assert tls_files_elsewhere(elsewhere.bootstrap)
    envoy_validate(elsewhere)

    openssl = shutil.which("openssl")
    assert openssl is not None, "this test needs the openssl command to make a certificate"
    cert, key = make_self_signed(tmp_path, openssl)
    here = render(with_tls(deployment, str(cert), str(key)))
    assert not tls_files_elsewhere(here.bootstrap)
    envoy_validate(here)
    key.write_text("not a key\n")
    with pytest.raises(EnvoyConfigError, match="private key"):
        envoy_validate(render(with_tls(deployment, str(cert), str(key))))


def make_self_signed(directory: Path, openssl: str) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
