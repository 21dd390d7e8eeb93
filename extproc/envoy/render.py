"""``fairlane render-envoy``: the Envoy bootstrap (or the mesh snippet) for a deployment file.

Three checks stand between the deployment YAML and a file Envoy will run: the deployment and
its policy are validated (``extproc.envoy.deployment``, every problem as
``file:line: field: message``); the rendered dicts are parsed into envoy-data-plane's typed
messages, nested ``typed_config`` included (``typed_check``); and ``envoy --mode validate``
runs on the exact YAML that is written, the only check that knows extension names and
semantic constraints. The YAML written is the rendered dict, not ``Bootstrap.to_dict()``,
whose field names Envoy would not accept (``_proto_field_names``). envoy-data-plane costs
about a second to import; only this command imports it (lazily), so the service's request
path never pays for it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.envoy.binary import validate
from extproc.envoy.bootstrap import render_bootstrap, render_yaml
from extproc.envoy.clusters import backend_cluster, extproc_cluster
from extproc.envoy.deployment import Deployment, DeploymentError, load_deployment
from extproc.envoy.generated import dump_yaml
from extproc.envoy.mesh import MESHES, render_mesh_yaml
from extproc.envoy.mesh.istio import istio_bootstrap
from extproc.envoy.params import (
    BACKEND_MAX_RETRIES,
    CATCH_ALL_ROUTE,
    NUM_RETRIES,
    RETRY_ON,
    EnvoyConfigError,
    EnvoyParams,
)
from extproc.envoy.replicas import HEALTH_CHECK_INTERVAL_S
from extproc.envoy.snippet import render_mesh_snippet, render_mesh_snippet_yaml, wrap_snippet
from extproc.envoy.tls import TLS_TRANSPORT_SOCKET

# Where the source checkout keeps its example deployment, if fairlane runs from one. A wheel
# has no deploy/ (its relative `policy:` would not resolve inside the package anyway).
CHECKOUT_DEPLOYMENT = Path(__file__).resolve().parents[2] / "deploy" / "fairlane.yaml"
_TYPE_URL_PREFIX = "type.googleapis.com/"
_BOOTSTRAP_URL = _TYPE_URL_PREFIX + "envoy.config.bootstrap.v3.Bootstrap"
_SNAKE = re.compile(r"[a-z][a-z0-9_]*")
_MESH_CHECKED = {
    "istio": "(checks ran on the EnvoyFilter's patches applied to a stand-in gateway config)",
    "envoy-gateway": "(checks ran on the bootstrap the objects' fields derive from; the "
    "Kubernetes objects themselves are not schema-validated)",
}


class TypedCheckError(ValueError):
    """envoy-data-plane's typed messages refused the rendered config."""


@dataclass(frozen=True)
class Rendered:
    """What ``render-envoy`` produced: the text to write and the dict Envoy will validate."""

    text: str
    bootstrap: dict[str, Any]
    """A whole bootstrap: the config itself, or the snippet wrapped in a minimal one."""
    bootstrap_text: str
    """``bootstrap`` as Envoy validates it: ``text`` itself, or the wrapped snippet."""
    typed_configs: int
    """How many ``typed_config`` Any messages the typed check unpacked."""


# --------------------------------------------------------------------------- typed check


def type_urls(config: Any) -> set[str]:
    """Every ``@type`` in a proto3-JSON-shaped dict (the nested typed_configs)."""
    found: set[str] = set()
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("@type"), str):
                found.add(item["@type"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _message_class(type_url: str) -> Any:
    """Import the envoy-data-plane module for ``type_url`` (registering its messages for
    ``Any``) and return the message class."""
    name = type_url.rsplit("/", 1)[-1]
    parts = name.split(".")
    split = next((i for i, part in enumerate(parts) if part[:1].isupper()), None)
    if split is None or split == 0:
        raise TypedCheckError(f"@type {type_url!r} does not name a message")
    module_name = "envoy_data_plane." + ".".join(parts[:split])
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TypedCheckError(
            f"@type {type_url!r}: envoy-data-plane has no module {module_name} ({exc})"
        ) from None
    cls: Any = module
    for part in parts[split:]:
        cls = getattr(cls, part, None)
        if cls is None:
            raise TypedCheckError(f"@type {type_url!r}: no message {name} in envoy-data-plane")
    return cls


@contextlib.contextmanager
def _proto_field_names() -> Iterator[None]:
    """Work around betterproto2 0.9 reading proto field names with digits.

    ``from_dict`` maps every key through ``safe_snake_case``, which turns
    ``consecutive_5xx`` into ``consecutive_5_xx`` while the generated attribute is
    ``consecutive_5xx``, so the (correct) key is refused as unknown. Keys that are already
    snake_case (our dicts use the proto field names) are kept as they are, only
    keyword-sanitised; camelCase keys still go through the library's conversion.
    """
    import betterproto2
    from betterproto2.casing import sanitize_name

    original = betterproto2.safe_snake_case

    def snake(key: str) -> str:
        return sanitize_name(key) if _SNAKE.fullmatch(key) else original(key)

    betterproto2.safe_snake_case = snake  # type: ignore[assignment]
    try:
        yield
    finally:
        betterproto2.safe_snake_case = original


def typed_check(bootstrap: dict[str, Any]) -> Any:
    """Parse ``bootstrap`` into envoy-data-plane's ``Bootstrap``; return the message.

    Raises :class:`TypedCheckError` naming the message that refused a field or value.

    betterproto2's ``from_dict`` rejects unknown fields, wrong types and unknown enum values,
    and unpacks every ``typed_config`` (a ``google.protobuf.Any``) into its own message class,
    so nested extension configs are checked too. ``Any`` resolves type URLs through a registry
    filled on import, so the modules for every ``@type`` in the dict are imported first; an
    ``@type`` without a module is an error, not a silent pass.
    """
    urls = type_urls(bootstrap)
    with warnings.catch_warnings():
        # envoy-data-plane's generated validators trip pydantic 2.12 deprecation warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        for url in sorted(urls | {_BOOTSTRAP_URL}):
            _message_class(url)
    bootstrap_cls = _message_class(_BOOTSTRAP_URL)
    try:
        with _proto_field_names():
            return bootstrap_cls.from_dict(bootstrap)
    except (KeyError, TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        detail = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise TypedCheckError(f"{type(exc).__name__}: {detail}") from None


# --------------------------------------------------------------------------- rendering


def render(deployment: Deployment, snippet: bool = False, mesh: str | None = None) -> Rendered:
    """Render the bootstrap (or the snippet, or a mesh's objects) for ``deployment`` and
    typed-check it. For a mesh, the bootstrap checked is the one its Envoy config comes
    from: for Istio the EnvoyFilter's patches applied to a stand-in gateway config
    (:func:`istio_bootstrap`), for Envoy Gateway the plain bootstrap its fields derive from."""
    params = deployment.params
    flag = " --snippet" if snippet else f" --mesh {mesh}" if mesh else ""
    generated_by = (
        f"GENERATED by `fairlane render-envoy{flag} "
        f"{_shown(deployment.source)}`\nfrom {_builder(snippet, mesh)} and the policy "
        f"{_shown(deployment.policy_path)}.\nDo not edit by hand: change the deployment or "
        "the policy and render again."
    )
    if mesh is not None:
        text = render_mesh_yaml(params, mesh, generated_by)
        objects = list(yaml.safe_load_all(text))
        bootstrap = istio_bootstrap(objects) if mesh == "istio" else render_bootstrap(params)
        typed_check(bootstrap)
        bootstrap_text = yaml.safe_dump(bootstrap, sort_keys=False)
        return Rendered(text, bootstrap, bootstrap_text, _count_typed_configs(bootstrap))
    if snippet:
        text = render_mesh_snippet_yaml(params, generated_by=generated_by)
        bootstrap = wrap_snippet(render_mesh_snippet(params))
    else:
        text = render_yaml(params, header=generated_by)
        bootstrap = render_bootstrap(params)
    # What Envoy will read is the text: check the dict parsed back from it, not the one we
    # hoped to dump.
    written = yaml.safe_load(text)
    if (wrap_snippet(written) if snippet else written) != bootstrap:
        raise TypedCheckError("the YAML written does not read back as the rendered config")
    typed_check(bootstrap)
    bootstrap_text = yaml.safe_dump(bootstrap, sort_keys=False) if snippet else text
    return Rendered(text, bootstrap, bootstrap_text, _count_typed_configs(bootstrap))


def _builder(snippet: bool, mesh: str | None) -> str:
    """The module that renders this kind of output, named in its header: where to look."""
    if mesh is not None:
        return f"extproc/envoy/mesh/{mesh.replace('-', '_')}.py"
    return "extproc/envoy/snippet.py" if snippet else "extproc/envoy/bootstrap.py"


def _match_text(match: dict[str, str]) -> str:
    return " ".join(f"{kind} {value}" for kind, value in match.items())


def _shown(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the working directory when it is below it (shorter headers)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return os.fspath(path)


def _count_typed_configs(config: Any) -> int:
    if isinstance(config, dict):
        own = 1 if "@type" in config else 0
        return own + sum(_count_typed_configs(v) for v in config.values())
    if isinstance(config, list):
        return sum(_count_typed_configs(v) for v in config)
    return 0


def _service_text(params: EnvoyParams) -> str:
    """Where the service is: one address, or the replicas and how Envoy fails over."""
    replicas = params.service_replicas
    if not params.replicated:
        return f"ext_proc service {replicas[0].address}"
    outlier = extproc_cluster(params)["outlier_detection"]
    return (
        f"ext_proc service: {len(replicas)} replicas "
        f"{', '.join(r.address for r in replicas)}\n"
        f"    TCP health checks every {HEALTH_CHECK_INTERVAL_S:g}s, ejected after "
        f"{outlier['consecutive_local_origin_failure']} connect failures or resets in a row, "
        "a stream that cannot open is retried on another replica; each client key's streams "
        "to one replica (Maglev); one completion feed each"
    )


def envoy_validate(rendered: Rendered) -> None:
    """``envoy --mode validate`` on the exact text (a temporary file; nothing is bound), so
    a file appears at ``-o`` only once Envoy accepted it.

    Envoy validates a listener's TLS by loading its certificate files, which often exist
    only where Envoy runs (its container): when they are not on this machine, the listener
    is validated without its TLS transport socket (``tls_files_elsewhere``)."""
    text = rendered.bootstrap_text
    if tls_files_elsewhere(rendered.bootstrap):
        text = dump_yaml(_without_tls(rendered.bootstrap))
    with tempfile.TemporaryDirectory(prefix="fairlane-render-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(text)
        validate(path)


def _tls_sockets(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    listeners = bootstrap.get("static_resources", {}).get("listeners", [])
    return [
        chain["transport_socket"]
        for listener in listeners
        for chain in listener.get("filter_chains", [])
        if chain.get("transport_socket", {}).get("name") == TLS_TRANSPORT_SOCKET
    ]


def tls_files_elsewhere(bootstrap: dict[str, Any]) -> bool:
    """Whether a listener's TLS certificate or key is not readable on this machine."""
    for socket in _tls_sockets(bootstrap):
        for pair in socket["typed_config"]["common_tls_context"]["tls_certificates"]:
            for source in (pair["certificate_chain"], pair["private_key"]):
                if not os.access(source["filename"], os.R_OK):
                    return True
    return False


def _without_tls(bootstrap: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(bootstrap)
    for listener in stripped["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            chain.pop("transport_socket", None)
    return stripped


def report(deployment: Deployment, rendered: Rendered, validated: bool) -> str:
    """A human summary of what Envoy will do (stderr, so stdout stays pure YAML)."""
    params = deployment.params
    extproc_limit = extproc_cluster(params)["circuit_breakers"]["thresholds"][0]["max_requests"]
    backends = backend_cluster(params)
    check = backends["health_checks"][0]
    outlier = backends["outlier_detection"]
    lines = [
        f"deployment {_shown(deployment.source)} (policy {_shown(deployment.policy_path)})",
        f"  listener {params.listen_host}:{params.listen_port}"
        f"{' (TLS)' if params.tls else ''}, admin "
        f"{params.admin_host}:{params.admin_port}, {_service_text(params)}",
        "  regions as priority levels (failover in this order; overprovisioning factor 140):",
    ]
    for priority, region in enumerate(params.regions):
        hosts = ", ".join(
            [f"{b.address} (weight {b.weight})" for b in params.backends if b.region == region]
            + [
                f"every address of {d.url}, from the service over EDS (weight {d.weight})"
                for d in params.dns_backends
                if d.region == region
            ]
        )
        lines.append(f"    priority {priority}: {region}: {hosts}")
    lines.append(
        f"  retries: retry_on {RETRY_ON}, num_retries {NUM_RETRIES}, "
        "previous_hosts + previous_priorities"
    )
    lines.append("  hedging (set per request by the service; counts against num_retries):")
    for hedge in deployment.hedging():
        target = f", slo_ttft_ms {hedge.slo_ttft_ms}" if hedge.slo_ttft_ms is not None else ""
        if hedge.per_try_timeout_ms is None:
            lines.append(f"    {hedge.tier}: off{target}")
        else:
            ratio = (
                f" ({hedge.per_try_timeout_ms / hedge.slo_ttft_ms:.1f}x the TTFT target)"
                if hedge.slo_ttft_ms
                else ""
            )
            lines.append(
                f"    {hedge.tier}: on, per-try timeout {hedge.per_try_timeout_ms} ms"
                f"{target}{ratio}"
            )
    lines += [
        f"  health checks: {check['http_health_check']['path']} every {check['interval']} "
        f"(no_traffic_interval {check['no_traffic_interval']}); outlier detection: "
        f"{outlier['consecutive_5xx']} consecutive 5xx or {outlier['consecutive_gateway_failure']}"
        " gateway failures eject a host",
        f"  circuit breakers: backends max_retries {BACKEND_MAX_RETRIES}; ext_proc max_requests "
        f"{extproc_limit} (policy queues hold {params.max_held_requests})",
        f"  longest hold {params.longest_hold_s:g}s, max body {params.max_body_bytes} bytes",
        "  when the service is down (closed: 503 from Envoy, open: forwarded unprocessed):",
        *(
            f"    {spec.name} {_match_text(spec.match)}: "
            f"{'open' if spec.failure_mode_allow else 'closed'}"
            for spec in params.routes
        ),
        f"    {CATCH_ALL_ROUTE} prefix /: {'open' if params.failure_mode_allow else 'closed'}",
        f"  typed check: OK (envoy-data-plane Bootstrap, {rendered.typed_configs} typed configs)",
        "  envoy --mode validate: " + ("OK" if validated else "skipped (--no-validate)"),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "deployment",
        nargs="?",
        type=Path,
        default=None,
        help="deployment YAML (default: deploy/fairlane.yaml when fairlane runs from a source "
        "checkout; required otherwise)",
    )
    parser.add_argument(
        "--snippet",
        action="store_true",
        help="only the ext_proc filter, route, settings and clusters for an existing Envoy",
    )
    parser.add_argument(
        "--mesh",
        choices=MESHES,
        default=None,
        help="Kubernetes objects for Istio (EnvoyFilter) or Envoy Gateway "
        "(EnvoyExtensionPolicy and policies); service.host must be NAME.NAMESPACE.svc...",
    )
    parser.add_argument(
        "-o", "--output", type=Path, default=None, help="write here instead of stdout"
    )
    parser.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="serve clients over TLS with this PEM certificate chain (a path as Envoy sees "
        "it; overrides the deployment's listen.tls)",
    )
    parser.add_argument("--tls-key", default=None, metavar="PATH", help="its PEM private key")
    parser.add_argument("--no-validate", action="store_true", help="skip `envoy --mode validate`")
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


def default_deployment() -> Path | None:
    """The checkout's ``deploy/fairlane.yaml``, or None when fairlane is installed (from a
    wheel, say): then the deployment must be named, and the error below says so."""
    return CHECKOUT_DEPLOYMENT if CHECKOUT_DEPLOYMENT.is_file() else None


def run(args: argparse.Namespace) -> int:
    path = args.deployment or default_deployment()
    if path is None:
        print(
            "fairlane render-envoy: no deployment file given, and there is no default outside "
            "a source checkout (its deploy/fairlane.yaml): name one, "
            "`fairlane render-envoy DEPLOYMENT.yaml` (envoy/README.md in the fairlane "
            "repository shows the shape)",
            file=sys.stderr,
        )
        return 2
    try:
        deployment = with_tls(load_deployment(path), args.tls_cert, args.tls_key)
        if args.snippet and args.mesh:
            raise EnvoyConfigError("--snippet and --mesh exclude each other")
        rendered = render(deployment, snippet=args.snippet, mesh=args.mesh)
        if not args.no_validate:
            envoy_validate(rendered)
    except DeploymentError as exc:
        print(f"fairlane render-envoy: invalid deployment:\n{exc}", file=sys.stderr)
        return 1
    except TypedCheckError as exc:
        print(f"fairlane render-envoy: typed check failed: {exc}", file=sys.stderr)
        return 1
    except EnvoyConfigError as exc:
        print(f"fairlane render-envoy: {exc}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(rendered.text)
    else:
        _write_atomically(args.output, rendered.text)
    if not args.quiet:
        print(report(deployment, rendered, not args.no_validate), file=sys.stderr)
        if args.mesh is not None:
            print(f"  {_MESH_CHECKED[args.mesh]}", file=sys.stderr)
        if args.output is not None:
            print(f"  written to {args.output}", file=sys.stderr)
    return 0


def with_tls(deployment: Deployment, cert: str | None, key: str | None) -> Deployment:
    """``deployment`` with ``--tls-cert``/``--tls-key`` (both or neither) on its listener."""
    if cert is None and key is None:
        return deployment
    if cert is None or key is None:
        raise EnvoyConfigError("--tls-cert and --tls-key go together")
    params = dataclasses.replace(
        deployment.params, tls_cert_path=os.path.abspath(cert), tls_key_path=os.path.abspath(key)
    )
    return dataclasses.replace(deployment, params=params)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` only with a complete file (Envoy may be restarted on it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
