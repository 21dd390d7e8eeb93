"""The deployment file: where Envoy listens, where the service and the backends are, which policy.

``fairlane render-envoy`` turns one of these into an Envoy bootstrap. The file names only the
topology; everything Envoy needs to know about scheduling (the largest body, the longest hold,
how many requests the queues may hold, which tiers hedge) is derived from the policy it points
at, so the gateway and Envoy cannot disagree about it. Optional keys override the derived
values for deployments that need to (a bigger listener buffer, a fixed hold cap).
``deploy/fairlane.yaml`` is the shipped example; ``Deployment`` shows the whole shape and
``_read_backends`` what a backend may say. A backend is an IP address or a ``dns://`` name
the service resolves, never a name Envoy resolves on its own: Envoy's override_host matches
the ``ip:port`` strings the service sends. Every problem in the file is reported at once, as
``file:line: field.path: message``, like the policy parser does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from yaml.nodes import MappingNode, Node, SequenceNode

from extproc.envoy.deployment_service import read_service
from extproc.envoy.params import (
    CATCH_ALL_ROUTE,
    MAX_MESSAGE_TIMEOUT_S,
    EnvoyConfigError,
    EnvoyParams,
    RouteSpec,
)
from extproc.fleet.backend import BackendSpec, KVEventPorts, is_secret_reference
from extproc.fleet.discovery import DnsBackendSpec, is_dns_backend, parse_dns_backend
from extproc.policy import DEFAULT_POLICY_PATH, Policy, PolicyError, load_policy
from extproc.yamlfile import LocatedReader, YamlSyntaxError, compose

# Seconds added to the policy's longest queue deadline for Envoy's hold cap (what
# ``fairlane up`` does): a request released at its deadline still gets forwarded.
HOLD_MARGIN_S = 10.0

_TOP_KEYS = (
    "listen",
    "admin",
    "service",
    "backends",
    "policy",
    "max_body_bytes",
    "longest_hold_s",
    "max_held_requests",
    "message_timeout_s",
    "access_log_path",
    "failure_mode",
    "routes",
    "tokenizer",
)
_ADDRESS_KEYS = ("host", "port")
_LISTEN_KEYS = ("host", "port", "tls")
_TLS_KEYS = ("cert", "key")
_BACKEND_KEYS = ("url", "region", "weight", "seats", "api_key", "kv_events", "kv_replay", "models")
_ROUTE_KEYS = ("name", "prefix", "path", "failure_mode")
FAILURE_MODES = {"closed": False, "open": True}
"""``failure_mode`` values -> ext_proc ``failure_mode_allow``."""


class DeploymentError(ValueError):
    """Every problem found in a deployment file, one ``file:line: field: message`` each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class TierHedging:
    """What Envoy does for one tier's requests (the service sets the per-request headers)."""

    tier: str
    per_try_timeout_ms: int | None
    """``hedge_after_ms``: after this long without response headers Envoy sends a copy to
    the next listed endpoint. None: the tier is not hedged."""
    slo_ttft_ms: int | None


@dataclass(frozen=True)
class Deployment:
    """A validated deployment file and the policy it names.

    The file's shape (``deploy/fairlane.yaml`` is the shipped example)::

        listen: {host: 127.0.0.1, port: 8080}      # clients; optional TLS, files as Envoy
        #   sees them: tls: {cert: /etc/envoy/tls/cert.pem, key: /etc/envoy/tls/key.pem}
        admin: {host: 127.0.0.1, port: 9901}       # Envoy admin; keep it on loopback
        service: {host: 127.0.0.1, port: 50051}    # the ext_proc service (fairlane serve); or
        # its replicas, each at its own address: extproc.envoy.deployment_service shows how
        policy: ../policies/default.yaml           # relative to this file; default: built-in
        backends:                                  # regions are priority levels, first = 0
          - {url: http://10.0.0.11:8000, region: us-east-1, weight: 2, seats: 64}
          - {url: http://10.1.0.11:8000, region: us-west-2}          # seats learned
          - {url: http://10.1.0.12:8000, region: us-west-2, api_key: env:VLLM_API_KEY}
          - {url: http://10.0.0.13:8000, region: us-east-1, kv_events: 5557, kv_replay: 5558}
          - {url: http://10.0.0.14:8000, region: us-east-1, models: [qwen-7b]}  # declared
          - {url: dns://vllm.llm.svc.cluster.local:8000, region: us-east-1}  # every address
        # tokenizer: /models/llama                # with kv_events: precise prefix routing
        # optional, default from the policy:
        # max_body_bytes, longest_hold_s, max_held_requests, message_timeout_s, access_log_path
        # optional: when the service is down (default closed: 503, never forwarded)
        failure_mode: closed                       # the catch-all route (generation)
        routes:                                    # extra routes, matched before the catch-all
          - {name: models, prefix: /v1/models, failure_mode: open}
    """

    source: str
    policy_path: Path
    policy: Policy
    params: EnvoyParams

    def hedging(self) -> list[TierHedging]:
        """Per tier, most urgent first: hedged or not, and with which per-try timeout."""
        return [
            TierHedging(tier.name, tier.hedge_after_ms, tier.slo_ttft_ms)
            for tier in self.policy.tiers
        ]


def load_deployment(path: str | os.PathLike[str]) -> Deployment:
    """Read and validate the deployment file at ``path`` and the policy it names.

    Raises :class:`DeploymentError` listing every problem (the policy's own problems keep
    the policy file's name and lines).
    """
    filename = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DeploymentError([f"{filename}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError:
        raise DeploymentError([f"{filename}: the file is not valid UTF-8"]) from None
    return parse_deployment(text, filename, base_dir=Path(path).resolve().parent)


def parse_deployment(
    text: str, filename: str = "<deployment>", base_dir: Path | None = None
) -> Deployment:
    """Validate a deployment in ``text``; a relative ``policy`` is taken from ``base_dir``."""
    try:
        root = compose(text, filename)
    except YamlSyntaxError as exc:
        raise DeploymentError([exc.message]) from None
    reader = LocatedReader(filename)
    if root is None:
        reader.error(None, "", "the deployment is empty (it needs at least `backends`)")
        raise DeploymentError(reader.errors)
    deployment = _read(reader, root, base_dir or Path.cwd())
    if reader.errors or deployment is None:
        raise DeploymentError(reader.errors)
    return deployment


# --------------------------------------------------------------------------- reading


def _port(allow_zero: bool) -> Callable[[Any], str | None]:
    low = 0 if allow_zero else 1
    return lambda v: None if low <= v <= 65535 else f"must be in [{low}, 65535], got {v}"


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be positive"


def _hold_range(value: Any) -> str | None:
    if 0 < value <= MAX_MESSAGE_TIMEOUT_S:
        return None
    return f"must be in (0, {MAX_MESSAGE_TIMEOUT_S:.0f}] (ext_proc's max_message_timeout)"


def _read(reader: LocatedReader, root: Node, base_dir: Path) -> Deployment | None:
    top = reader.mapping(root, "", _TOP_KEYS)
    if not isinstance(root, MappingNode):
        return None
    kwargs: dict[str, Any] = {}
    for key, (host_field, port_field), allow_zero in (
        ("listen", ("listen_host", "listen_port"), True),
        ("admin", ("admin_host", "admin_port"), True),
    ):
        if key in top:
            address = reader.mapping(
                top[key], key, _LISTEN_KEYS if key == "listen" else _ADDRESS_KEYS
            )
            if "tls" in address:
                kwargs.update(_read_tls(reader, address["tls"]))
            if "host" in address:
                kwargs[host_field] = reader.value(address["host"], f"{key}.host", str, _non_empty)
            if "port" in address:
                kwargs[port_field] = reader.value(
                    address["port"], f"{key}.port", int, _port(allow_zero)
                )
    if "service" in top:
        kwargs.update(read_service(reader, top["service"]))
    if "failure_mode" in top:
        kwargs["failure_mode_allow"] = _read_failure_mode(reader, top["failure_mode"], "")
    if "routes" in top:
        kwargs["routes"] = _read_routes(reader, top["routes"])
    if "tokenizer" in top:
        kwargs["service_tokenizer"] = reader.value(top["tokenizer"], "tokenizer", str, _non_empty)
    if "backends" in top:
        backends = _read_backends(reader, top["backends"])
        kwargs["backends"] = tuple(b for b in backends if isinstance(b, BackendSpec))
        kwargs["dns_backends"] = tuple(b for b in backends if isinstance(b, DnsBackendSpec))
        kwargs["region_order"] = tuple(dict.fromkeys(b.region for b in backends))
    else:
        reader.error(root, "backends", "is required (the vLLM servers Envoy routes to)")
    policy_path, policy = _read_policy(reader, top.get("policy"), base_dir)
    for key, kind, check in (
        ("max_body_bytes", int, _positive),
        ("max_held_requests", int, _positive),
        ("longest_hold_s", float, _hold_range),
        ("message_timeout_s", float, _hold_range),
        ("access_log_path", str, _non_empty),
    ):
        if key in top:
            kwargs[key] = reader.value(top[key], key, kind, check)
    if reader.errors or policy is None or policy_path is None:
        return None
    kwargs.setdefault("max_body_bytes", policy.max_body_bytes)
    longest_deadline = max(tier.queue_deadline_s for tier in policy.tiers)
    kwargs.setdefault(
        "longest_hold_s", min(MAX_MESSAGE_TIMEOUT_S, longest_deadline + HOLD_MARGIN_S)
    )
    kwargs.setdefault("max_held_requests", max(1, sum(tier.queue_limit for tier in policy.tiers)))
    try:
        params = EnvoyParams(**kwargs)
    except EnvoyConfigError as exc:  # cross-field problems (a backend listed twice, ...)
        reader.error(root, "", str(exc))
        return None
    return Deployment(reader.filename, policy_path, policy, params)


def _read_tls(reader: LocatedReader, node: Node) -> dict[str, str]:
    """``listen.tls: {cert, key}``: absolute paths as Envoy sees them (it reads the files)."""
    fields = reader.mapping(node, "listen.tls", _TLS_KEYS)
    paths: dict[str, str] = {}
    for key, param in (("cert", "tls_cert_path"), ("key", "tls_key_path")):
        if key not in fields:
            reader.error(node, f"listen.tls.{key}", "is required (a PEM file Envoy can read)")
            continue
        value = reader.value(fields[key], f"listen.tls.{key}", str, _absolute_path)
        if value is not None:
            paths[param] = value
    return paths


def _absolute_path(value: str) -> str | None:
    if value.startswith("/"):
        return None
    return "must be an absolute path, as Envoy (its container) sees the file"


def _secret_reference(value: str) -> str | None:
    if is_secret_reference(value):
        return None
    return (
        "must be env:NAME or file:PATH (where the service reads the engine's key; the key "
        "itself never goes in this file)"
    )


def _read_failure_mode(reader: LocatedReader, node: Node, path: str) -> bool | None:
    field_path = f"{path}.failure_mode" if path else "failure_mode"
    value = reader.value(
        node,
        field_path,
        str,
        lambda v: None if v in FAILURE_MODES else f"must be one of {sorted(FAILURE_MODES)}",
    )
    return None if value is None else FAILURE_MODES[value]


def _read_routes(reader: LocatedReader, node: Node) -> tuple[RouteSpec, ...]:
    """Extra routes with their failure mode; the catch-all ``/`` route always comes last."""
    if not isinstance(node, SequenceNode):
        reader.error(node, "routes", "must be a list of {name, prefix|path, failure_mode}")
        return ()
    specs: list[RouteSpec] = []
    seen: set[str] = set()
    for index, item in enumerate(node.value):
        path = f"routes[{index}]"
        fields = reader.mapping(item, path, _ROUTE_KEYS)
        if not isinstance(item, MappingNode):
            continue
        matches = [key for key in ("prefix", "path") if key in fields]
        if len(matches) != 1:
            reader.error(item, path, "needs exactly one of `prefix` and `path`")
            continue
        match = reader.value(
            fields[matches[0]],
            f"{path}.{matches[0]}",
            str,
            lambda v: None if v.startswith("/") else "must start with '/'",
        )
        name = (
            reader.value(fields["name"], f"{path}.name", str, _non_empty)
            if "name" in fields
            else f"fairlane_route_{index}"
        )
        allow = (
            _read_failure_mode(reader, fields["failure_mode"], path)
            if "failure_mode" in fields
            else False
        )
        if match is None or name is None or allow is None:
            continue
        if name in seen or name == CATCH_ALL_ROUTE:
            reader.error(fields.get("name", item), f"{path}.name", f"{name!r} is already taken")
            continue
        seen.add(name)
        specs.append(RouteSpec(name=name, failure_mode_allow=allow, **{matches[0]: match}))
    return tuple(specs)


def _read_backends(reader: LocatedReader, node: Node) -> tuple[BackendSpec | DnsBackendSpec, ...]:
    """The ``backends`` list, each one read by ``_read_backend``.

    A backend is a fixed IP address (``http://IP:PORT``) or a DNS name (``dns://NAME:PORT``),
    never ``http://NAME``: Envoy's override_host matches the ``ip:port`` strings the service
    sends against the cluster's host addresses, so a name Envoy resolved on its own (STRICT_DNS)
    would hold addresses the service never names. A ``dns://`` name is resolved by the service
    (``extproc.fleet.resolver``), each address a backend, and Envoy learns the same set from the
    service over EDS (``extproc.envoy.clusters``); the service's ``--backend`` takes the same
    ``dns://`` URL. The service itself may be a DNS name: nothing matches strings against the
    ext_proc cluster, which is rendered as STRICT_DNS then.

    A backend's optional ``seats`` declares how many requests its engine runs at once (its
    ``--max-num-seqs``, which vLLM does not export); without it the service learns the count
    from the engine (``extproc.fleet.seats``). Envoy does not use it: the service does, and it
    is given its backends on its command line, so the same count goes on the service's
    ``--backend`` as ``#seats=N`` (``tests/deploy/test_compose.py`` checks that the compose
    files agree). ``models`` (what the engine serves, until its ``/v1/models`` is read) goes
    there as ``#models=A|B``. ``api_key`` is the same kind of field: where the engine's
    ``--api-key`` is read from (``env:NAME`` or ``file:PATH``, never the key itself), for the
    service's ``--backend`` as ``#key=...`` (``extproc.transport.credentials``); Envoy never
    sees the key. ``kv_events`` and ``kv_replay`` are the ports the engine publishes its KV
    events on (``#kv-events=``, ``#kv-replay=``), and the top-level ``tokenizer`` the served
    model's directory as the service's container sees it (``--tokenizer``): together they turn
    on precise prefix routing.
    """
    if not isinstance(node, SequenceNode) or not node.value:
        reader.error(
            node, "backends", "must be a non-empty list of {url, region, weight, seats, api_key}"
        )
        return ()
    specs: list[BackendSpec | DnsBackendSpec] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(node.value):
        path = f"backends[{index}]"
        fields = reader.mapping(item, path, _BACKEND_KEYS)
        if not isinstance(item, MappingNode):
            continue
        if "url" not in fields:
            reader.error(item, f"{path}.url", "is required (http://IP:PORT or dns://NAME:PORT)")
            continue
        spec = _read_backend(reader, fields, path)
        if spec is None:
            continue
        where = spec.address if isinstance(spec, BackendSpec) else spec.url
        if where in seen:
            reader.error(
                fields["url"],
                f"{path}.url",
                f"{where} is already backends[{seen[where]}]",
            )
            continue
        seen[where] = index
        specs.append(spec)
    return tuple(specs)


def _read_backend(
    reader: LocatedReader, fields: dict[str, Node], path: str
) -> BackendSpec | DnsBackendSpec | None:
    """One backend's fields (``url`` present); None after reporting what is wrong."""
    url = reader.value(fields["url"], f"{path}.url", str, _non_empty)
    region = (
        reader.value(fields["region"], f"{path}.region", str, _non_empty)
        if "region" in fields
        else "default"
    )
    weight = (
        reader.value(fields["weight"], f"{path}.weight", int, _at_least_one)
        if "weight" in fields
        else 1
    )
    seats = (
        reader.value(fields["seats"], f"{path}.seats", int, _seats_range)
        if "seats" in fields
        else None
    )
    api_key = (
        reader.value(fields["api_key"], f"{path}.api_key", str, _secret_reference)
        if "api_key" in fields
        else None
    )
    ports = {
        key: reader.value(fields[key], f"{path}.{key}", int, _port(False))
        for key in ("kv_events", "kv_replay")
        if key in fields
    }
    models: tuple[str, ...] = ()
    if "models" in fields:
        names = reader.strings(fields["models"], f"{path}.models")
        if not names or not all(names):
            reader.error(fields["models"], f"{path}.models", "must be a list of model names")
            return None
        models = tuple(names)
    if url is None or region is None or weight is None:
        return None
    if ("seats" in fields and seats is None) or ("api_key" in fields and api_key is None):
        return None
    if None in ports.values():
        return None
    if "kv_replay" in ports and "kv_events" not in ports:
        reader.error(fields["kv_replay"], f"{path}.kv_replay", "needs kv_events (the stream)")
        return None
    kv_events = (
        KVEventPorts(ports["kv_events"], ports.get("kv_replay")) if "kv_events" in ports else None
    )
    if is_dns_backend(url):
        try:
            name = parse_dns_backend(url)
            return DnsBackendSpec(
                name.name, name.port, region.strip(), weight, seats, api_key, kv_events, models
            )
        except ValueError as exc:
            reader.error(fields["url"], f"{path}.url", str(exc))
            return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        reader.error(
            fields["url"],
            f"{path}.url",
            f"expected http://IP:PORT or dns://NAME:PORT, got {url!r}",
        )
        return None
    try:
        return BackendSpec(
            parts.hostname, port, region.strip(), weight, seats, api_key, kv_events, models
        )
    except ValueError as exc:
        hint = (
            "; give the backend a fixed address, or write dns://NAME:PORT to follow every "
            "address the name resolves to"
            if "IP address" in str(exc)
            else ""
        )
        reader.error(fields["url"], f"{path}.url", f"{exc}{hint}")
        return None


def _at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def _seats_range(value: int) -> str | None:
    if value >= 1:
        return None
    return "must be >= 1 (the requests the engine runs at once, --max-num-seqs)"


def _read_policy(
    reader: LocatedReader, node: Node | None, base_dir: Path
) -> tuple[Path | None, Policy | None]:
    if node is None:
        path = DEFAULT_POLICY_PATH
    else:
        name = reader.value(node, "policy", str, _non_empty)
        if name is None:
            return None, None
        path = Path(name).expanduser()
        if not path.is_absolute():
            path = (base_dir / path).resolve()
        if not path.is_file():
            reader.error(node, "policy", f"no such file: {path}")
            return None, None
    try:
        return path, load_policy(path)
    except PolicyError as exc:
        for problem in exc.errors:
            reader.error(node, "policy", problem)
        return path, None
