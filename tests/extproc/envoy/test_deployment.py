"""The deployment file's per-backend ``seats``: read into ``BackendSpec.seats``, refused with
``file:line`` when it is not a count of at least one, and of no concern to Envoy."""

from __future__ import annotations

import pytest

from extproc.envoy.bootstrap import render_yaml
from extproc.envoy.deployment import DeploymentError, parse_deployment
from extproc.fleet.backend import KVEventPorts

BACKENDS = """\
backends:
  - {url: http://10.0.0.11:8000, region: east, weight: 2, seats: 64}
  - url: http://10.0.0.12:8000
    region: east
    seats: %s
  - {url: http://10.1.0.11:8000, region: west}
"""


def errors(text: str) -> list[str]:
    with pytest.raises(DeploymentError) as caught:
        parse_deployment(text, "d.yaml")
    return caught.value.errors


def test_declared_seats_reach_the_backend_specs_and_the_rest_are_learned() -> None:
    backends = parse_deployment(BACKENDS % 8, "d.yaml").params.backends
    assert [(b.address, b.weight, b.seats) for b in backends] == [
        ("10.0.0.11:8000", 2, 64),
        ("10.0.0.12:8000", 1, 8),
        ("10.1.0.11:8000", 1, None),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "must be >= 1 (the requests the engine runs at once, --max-num-seqs)"),
        ("-4", "must be >= 1 (the requests the engine runs at once, --max-num-seqs)"),
        ("lots", "must be an integer, not a string"),
        ("2.5", "must be an integer, not a number"),
        ("true", "must be an integer, not a boolean"),
        ("null", "must be an integer, not null"),
    ],
)
def test_a_bad_seat_count_is_named_with_its_line(value: str, message: str) -> None:
    assert errors(BACKENDS % value) == [f"d.yaml:5: backends[1].seats: {message}"]


def test_every_bad_backend_is_reported_at_once() -> None:
    text = """\
backends:
  - {url: http://10.0.0.11:8000, seats: 0}
  - {url: http://10.0.0.12:8000, seats: 4, seat: 4}
  - {url: http://10.0.0.13:8000, weight: 0, seats: many}
"""
    found = errors(text)
    assert "d.yaml:2: backends[0].seats: must be >= 1" in found[0]
    assert any(e.startswith("d.yaml:3: backends[1].seat:") for e in found), found
    assert "d.yaml:4: backends[2].weight: must be >= 1" in found
    assert "d.yaml:4: backends[2].seats: must be an integer, not a string" in found


def test_envoy_is_rendered_the_same_with_or_without_seats() -> None:
    """Seats are the service's business (admission); Envoy routes to the same endpoints."""
    declared = parse_deployment(BACKENDS % 8, "d.yaml").params
    plain = parse_deployment(
        BACKENDS.replace(", seats: 64", "").replace("    seats: %s\n", ""), "d.yaml"
    ).params
    assert render_yaml(declared) == render_yaml(plain)


def test_api_key_is_a_reference_for_the_service_and_never_reaches_envoy() -> None:
    keyed = BACKENDS.replace("region: west}", "region: west, api_key: env:VLLM_API_KEY}")
    params = parse_deployment(keyed % 8, "d.yaml").params
    assert [b.credential for b in params.backends] == [None, None, "env:VLLM_API_KEY"]
    plain = parse_deployment(BACKENDS % 8, "d.yaml").params
    assert render_yaml(params) == render_yaml(plain)


def test_a_plaintext_api_key_is_refused_with_its_line() -> None:
    keyed = BACKENDS.replace("region: west}", "region: west, api_key: sk-live-0123}")
    (found,) = errors(keyed % 8)
    assert found.startswith("d.yaml:6: backends[2].api_key: must be env:NAME or file:PATH")


def test_listen_tls_names_the_files_envoy_reads() -> None:
    text = "listen: {port: 8443, tls: {cert: /etc/tls/c.pem, key: /etc/tls/k.pem}}\n"
    params = parse_deployment(text + BACKENDS % 8, "d.yaml").params
    assert (params.tls_cert_path, params.tls_key_path) == ("/etc/tls/c.pem", "/etc/tls/k.pem")
    assert params.tls


def test_listen_tls_needs_both_absolute_paths() -> None:
    found = errors("listen: {tls: {cert: tls/c.pem}}\n" + BACKENDS % 8)
    assert "d.yaml:1: listen.tls.key: is required (a PEM file Envoy can read)" in found
    assert any(e.startswith("d.yaml:1: listen.tls.cert: must be an absolute path") for e in found)


DNS_BACKENDS = """\
backends:
  - {url: "dns://vllm-west.llm.svc.cluster.local:8000", region: west, seats: 16}
  - {url: http://10.0.0.11:8000, region: east}
  - {url: "dns://vllm-east:8000", region: east, api_key: env:VLLM_API_KEY}
"""


def test_dns_backends_mix_with_fixed_ones_and_keep_the_region_order() -> None:
    params = parse_deployment(DNS_BACKENDS, "d.yaml").params
    assert [b.address for b in params.backends] == ["10.0.0.11:8000"]
    assert [(d.url, d.region, d.seats, d.credential) for d in params.dns_backends] == [
        ("dns://vllm-west.llm.svc.cluster.local:8000", "west", 16, None),
        ("dns://vllm-east:8000", "east", None, "env:VLLM_API_KEY"),
    ]
    assert params.regions == ("west", "east")  # the DNS backend named west first


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("dns://vllm", "the port is required"),
        ("dns://10.0.0.5:8000", "an IP address, not a name: write http://IP:PORT"),
        ("http://vllm:8000", "must be an IP address"),
    ],
)
def test_a_bad_dns_backend_is_named_with_its_line(url: str, message: str) -> None:
    (error,) = errors(f'backends:\n  - {{url: "{url}"}}\n')
    assert error.startswith("d.yaml:2: backends[0].url: ") and message in error, error


def test_a_name_listed_twice_is_refused() -> None:
    text = 'backends:\n  - {url: "dns://vllm:8000"}\n  - {url: "dns://vllm:8000", region: b}\n'
    assert errors(text) == ["d.yaml:3: backends[1].url: dns://vllm:8000 is already backends[0]"]


def test_kv_event_ports_and_the_tokenizer_are_for_the_service_only() -> None:
    """Precise prefix routing: the engines' KV event ports per backend and the model's
    tokenizer reach the service's flags; Envoy is rendered as without them."""
    text = "tokenizer: /models/llama\n" + BACKENDS.replace(
        "region: west}", "region: west, kv_events: 5557, kv_replay: 5558}"
    )
    params = parse_deployment(text % 8, "d.yaml").params
    assert [b.kv_events for b in params.backends] == [None, None, KVEventPorts(5557, 5558)]
    assert params.service_tokenizer == "/models/llama"
    assert render_yaml(params) == render_yaml(parse_deployment(BACKENDS % 8, "d.yaml").params)


def test_bad_kv_event_ports_are_refused_with_their_line() -> None:
    replay_only = BACKENDS.replace("region: west}", "region: west, kv_replay: 5558}")
    (found,) = errors(replay_only % 8)
    assert found.startswith("d.yaml:6: backends[2].kv_replay: needs kv_events")
    zero = BACKENDS.replace("region: west}", "region: west, kv_events: 0}")
    (found,) = errors(zero % 8)
    assert found.startswith("d.yaml:6: backends[2].kv_events: must be in [1, 65535]")


def test_declared_models_reach_the_service_and_a_bad_list_is_named_with_its_line() -> None:
    text = (
        "backends:\n"
        "  - {url: http://10.0.0.1:8000, models: [llama-70b, llama]}\n"
        "  - {url: dns://qwen.svc:8000, models: [qwen-7b]}\n"
    )
    params = parse_deployment(text, "d.yaml").params
    assert params.backends[0].models == ("llama-70b", "llama")
    assert params.dns_backends[0].models == ("qwen-7b",)
    bad = errors("backends:\n  - {url: http://10.0.0.1:8000, models: []}\n")
    assert bad == ["d.yaml:2: backends[0].models: must be a list of model names"]
