"""``fairlane render-envoy``: the Envoy bootstrap (or the mesh snippet) for a deployment file.

Three checks stand between the deployment YAML and a file Envoy will run:

1. the deployment and its policy are validated (``extproc.deployment``), every problem
   reported as ``file:line: field: message``;
2. the rendered dicts are parsed into envoy-data-plane's typed messages (``Bootstrap``).
   betterproto2's ``from_dict`` rejects unknown fields, wrong types and unknown enum values,
   and unpacks every ``typed_config`` (a ``google.protobuf.Any``) into its own message class,
   so nested extension configs are checked too. ``Any`` resolves type URLs through a
   registry filled on import, so the modules for every ``@type`` in the dict are imported
   first; an ``@type`` without a module is an error, not a silent pass;
3. ``envoy --mode validate`` on the exact YAML that is written (unless ``--no-validate``):
   the only check that knows extension names and semantic constraints.

The YAML written is the rendered dict, not ``Bootstrap.to_dict()``: betterproto2 0.9
snake-cases ``consecutive_5xx`` as ``consecutive_5_xx`` in both directions (see
:func:`_proto_field_names`), so its output would not be a config Envoy accepts.

envoy-data-plane costs about a second to import; only this command imports it (lazily), so
the service's request path never pays for it.
"""

from __future__ import annotations

import argparse
import contextlib
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
from urllib.parse import urlsplit

import yaml

from extproc.deployment import Deployment, DeploymentError, load_deployment
from extproc.envoy_config import (
    BACKEND_MAX_REQUESTS,
    BACKEND_MAX_RETRIES,
    CATCH_ALL_ROUTE,
    DESTINATION_HEADER,
    NUM_RETRIES,
    RETRY_ON,
    EnvoyConfigError,
    EnvoyParams,
    RouteSpec,
    backend_cluster,
    ext_proc_filter,
    extproc_cluster,
    failure_mode_override,
    hcm_settings,
    render_bootstrap,
    render_mesh_snippet,
    render_mesh_snippet_yaml,
    render_yaml,
    route,
    validate,
    wrap_snippet,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DEPLOYMENT = REPO / "deploy" / "fairlane.yaml"
_TYPE_URL_PREFIX = "type.googleapis.com/"
_BOOTSTRAP_URL = _TYPE_URL_PREFIX + "envoy.config.bootstrap.v3.Bootstrap"
_SNAKE = re.compile(r"[a-z][a-z0-9_]*")


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
        f"{_shown(deployment.source)}`\nfrom extproc/envoy_config.py and the policy "
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


def envoy_validate(rendered: Rendered) -> None:
    """``envoy --mode validate`` on the exact text (a temporary file; nothing is bound), so
    a file appears at ``-o`` only once Envoy accepted it."""
    with tempfile.TemporaryDirectory(prefix="fairlane-render-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(rendered.bootstrap_text)
        validate(path)


def report(deployment: Deployment, rendered: Rendered, validated: bool) -> str:
    """A human summary of what Envoy will do (stderr, so stdout stays pure YAML)."""
    params = deployment.params
    extproc_limit = extproc_cluster(params)["circuit_breakers"]["thresholds"][0]["max_requests"]
    backends = backend_cluster(params)
    check = backends["health_checks"][0]
    outlier = backends["outlier_detection"]
    lines = [
        f"deployment {_shown(deployment.source)} (policy {_shown(deployment.policy_path)})",
        f"  listener {params.listen_host}:{params.listen_port}, admin "
        f"{params.admin_host}:{params.admin_port}, ext_proc service "
        f"{params.extproc_host}:{params.extproc_port}",
        "  regions as priority levels (failover in this order; overprovisioning factor 140):",
    ]
    for priority, region in enumerate(params.regions):
        hosts = ", ".join(
            f"{b.address} (weight {b.weight})" for b in params.backends if b.region == region
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
        default=DEFAULT_DEPLOYMENT,
        help="deployment YAML (default: deploy/fairlane.yaml of this checkout)",
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
    parser.add_argument("--no-validate", action="store_true", help="skip `envoy --mode validate`")
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        deployment = load_deployment(args.deployment)
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


# --------------------------------------------------------------------------- other meshes
#
# The same ext_proc filter, clusters, route settings and HCM settings as the bootstrap, but
# delivered the way Istio (an EnvoyFilter) and Envoy Gateway (Gateway API + its policies)
# take them. Everything Envoy-side is taken from the builders in extproc/envoy_config.py
# (Istio patches carry them verbatim; Envoy Gateway's fields are derived from them), so the
# meshes cannot drift from the bootstrap; tests/deploy/test_mesh_snippets.py checks both.

MESHES = ("istio", "envoy-gateway")
_MESH_CHECKED = {
    "istio": "(checks ran on the EnvoyFilter's patches applied to a stand-in gateway config)",
    "envoy-gateway": "(checks ran on the bootstrap the objects' fields derive from; the "
    "Kubernetes objects themselves are not schema-validated)",
}
VLLM_SERVICE = "vllm"
"""The Kubernetes Service in front of the vLLM pods (rename it in the rendered file)."""
GATEWAY = "llm-gateway"
FAIRLANE_IMAGE = "fairlane:dev"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)
ROUTER_FILTER = "envoy.filters.http.router"
GATEWAY_API = "gateway.networking.k8s.io"
ENVOY_GATEWAY_API = "gateway.envoyproxy.io/v1alpha1"
ISTIO_API = "networking.istio.io/v1alpha3"
# Envoy Gateway's names for ext_proc body modes (ExtProcBodyProcessingMode).
_EG_BODY_MODES = {"BUFFERED": "Buffered", "STREAMED": "Streamed"}
_METRICS_PORT = 9090

ISTIO_HEADER = """\
Istio: fairlane's ext_proc filter in the ingress gateway, as an EnvoyFilter.

Needs: Istio with EnvoyFilter (networking.istio.io/v1alpha3) whose proxy is an Envoy with
  - envoy.filters.http.ext_proc with max_message_timeout/override_message_timeout,
    status_on_error and metadata_options.receiving_namespaces;
  - envoy.load_balancing_policies.override_host (the upstream LB policy that routes to the
    ip:port the service names in x-gateway-destination-endpoint, alternates for retries);
  check `istioctl version` / the proxy's `envoy --version`: this file is validated against
  Envoy 1.40.0 (tests/deploy/test_mesh_snippets.py); older proxies may lack override_host.
What the mesh must provide:
  - the vLLM pods behind the Service `vllm` (rename below), the gateway's outbound cluster
    for it is patched to override_host: its endpoints are pod IP:port, which is what the
    service must list (`fairlane serve --backend REGION=http://POD_IP:PORT`, a static list:
    restart the service when vLLM pods move);
  - the fairlane Service reachable in plain gRPC (h2c) from the gateway: the Deployment
    below runs without a sidecar; with STRICT mTLS in its namespace use PERMISSIVE for it;
  - Gateway + VirtualService routes named like the HTTP_ROUTE patches (the VirtualService
    below), because EnvoyFilter matches routes by name.
The filter is inserted disabled and enabled per route (ExtProcPerRoute on fairlane's routes):
the gateway's other routes never reach fairlane.
Apply: kubectl apply -f istio.yaml (the EnvoyFilter lives in istio-system, beside the gateway).
"""

ENVOY_GATEWAY_HEADER = """\
Envoy Gateway: fairlane as an EnvoyExtensionPolicy (ext_proc) on the LLM HTTPRoutes.

Needs a recent Envoy Gateway (gateway.envoyproxy.io/v1alpha1) with these fields; written
against its current API types and checked structurally, not tried on a cluster:
  - EnvoyExtensionPolicy extProc (backendRefs, processingMode, messageTimeout, failOpen,
    metadata.writableNamespaces);
  - BackendTrafficPolicy loadBalancer.endpointOverride (Envoy's override_host LB policy:
    routes to the ip:port the service names in x-gateway-destination-endpoint, then its
    alternates for retries); Envoy Gateway's proxy must be an Envoy that has override_host;
  - EnvoyProxy telemetry accessLog ALS sink (the completion feed that frees backend slots);
  - ClientTrafficPolicy connection.bufferLimit and timeout.http.streamIdleTimeout.
What differs from the plain Envoy bootstrap (Envoy Gateway exposes no such fields):
  - no max_message_timeout: a held request is bounded by messageTimeout itself, set to the
    longest hold; a wedged service therefore holds requests that long instead of failing them
    after 2 s (the bootstrap's message_timeout);
  - no mutation_rules.allow_envoy: the service's x-envoy-* headers (per-request hedging,
    x-envoy-max-retries) are rejected (rejected_header_mutations), so there is no hedging and
    retries follow the BackendTrafficPolicy;
  - no status_on_error: a failed ext_proc stream answers 500 (Envoy's default), not 503.
What the mesh must provide: the vLLM pods behind the Service `vllm` (rename below); their pod
IP:port is what the service lists (`--backend REGION=http://POD_IP:PORT`, a static list).
Per-route fail-open: one HTTPRoute and one EnvoyExtensionPolicy per route of the deployment.
"""


@dataclass(frozen=True)
class KubeNames:
    """Where fairlane runs in Kubernetes, read from the deployment's ``service.host``."""

    service: str
    namespace: str
    backend_port: int

    @property
    def vllm_host(self) -> str:
        return f"{VLLM_SERVICE}.{self.namespace}.svc.cluster.local"


def kube_names(params: EnvoyParams) -> KubeNames:
    """``service.host`` must be ``NAME.NAMESPACE.svc.cluster.local``: the Kubernetes Service
    of fairlane, which the mesh renders name and namespace from."""
    parts = params.extproc_host.split(".")
    if len(parts) < 3 or parts[2] != "svc":
        raise EnvoyConfigError(
            "a mesh config needs service.host = NAME.NAMESPACE.svc.cluster.local (fairlane's "
            f"Kubernetes Service), got {params.extproc_host!r}"
        )
    ports = {backend.port for backend in params.backends}
    if len(ports) != 1:
        raise EnvoyConfigError(
            f"the backends must share one port (the vLLM pods' port), got {sorted(ports)}"
        )
    return KubeNames(parts[0], parts[1], ports.pop())


def kube_name(route_name: str) -> str:
    """A route name as a Kubernetes object name (DNS-1123: no underscores)."""
    return route_name.replace("_", "-").lower()


def route_merge(rendered_route: dict[str, Any]) -> dict[str, Any]:
    """What a mesh merges into its own route: the rendered route without name, match and
    cluster (the mesh's route names the cluster and matches the path)."""
    merged = {k: v for k, v in rendered_route.items() if k not in ("name", "match")}
    merged["route"] = {k: v for k, v in rendered_route["route"].items() if k != "cluster"}
    return merged


def scoped_ext_proc_filter(params: EnvoyParams) -> dict[str, Any]:
    """The ext_proc filter, disabled unless a route enables it.

    A mesh's listener serves other applications' routes too; with the filter on by default
    each of them would go through fairlane, fail-closed. ``HttpFilter.disabled`` keeps it
    off, and a valid per-route config (:func:`enabling_route_merge`) turns it on for
    fairlane's routes only."""
    return {**ext_proc_filter(params), "disabled": True}


def enabling_route_merge(
    rendered_route: dict[str, Any], failure_mode_allow: bool
) -> dict[str, Any]:
    """:func:`route_merge` plus the ``ExtProcPerRoute`` that enables the (disabled by
    default) ext_proc filter on this route, with the route's failure mode."""
    merged = route_merge(rendered_route)
    merged["typed_per_filter_config"] = failure_mode_override(failure_mode_allow)
    return merged


def backend_cluster_merge(params: EnvoyParams) -> dict[str, Any]:
    """What a mesh merges into its own cluster of the vLLM Service: override_host routing,
    raised circuit breakers and the buffer limit (its endpoints come from the mesh)."""
    cluster = backend_cluster(params)
    keys = ("per_connection_buffer_limit_bytes", "load_balancing_policy", "circuit_breakers")
    return {key: cluster[key] for key in keys}


def _workload(params: EnvoyParams, names: KubeNames) -> list[dict[str, Any]]:
    """fairlane's Deployment and Service. The backends are the deployment's, by IP."""
    labels = {"app": names.service}
    args = [
        "serve",
        "--host=0.0.0.0",
        f"--port={params.extproc_port}",
        f"--metrics-port={_METRICS_PORT}",
        *(f"--backend={b.region}={b.url}" for b in params.backends),
    ]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.service, "namespace": names.namespace},
        "spec": {
            "replicas": 1,  # queues and fairness counters are per process
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    # plain h2c from the gateway, plain HTTP to the vLLM pods' /metrics
                    "annotations": {"sidecar.istio.io/inject": "false"},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "fairlane",
                            "image": FAIRLANE_IMAGE,
                            "args": args,
                            "ports": [
                                {"name": "grpc", "containerPort": params.extproc_port},
                                {"name": "metrics", "containerPort": _METRICS_PORT},
                            ],
                        }
                    ]
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.service, "namespace": names.namespace},
        "spec": {
            "selector": labels,
            "ports": [
                {
                    "name": "grpc",
                    "port": params.extproc_port,
                    "targetPort": params.extproc_port,
                    "appProtocol": "kubernetes.io/h2c",
                },
                {"name": "http-metrics", "port": _METRICS_PORT, "targetPort": _METRICS_PORT},
            ],
        },
    }
    return [deployment, service]


def _route_specs(params: EnvoyParams) -> list[tuple[dict[str, Any], bool]]:
    """Each rendered route with its failure mode (fail-open or not), catch-all last."""
    specs: list[RouteSpec | None] = [*params.routes, None]
    return [
        (
            route(params, spec),
            params.failure_mode_allow if spec is None else spec.failure_mode_allow,
        )
        for spec in specs
    ]


def render_istio(params: EnvoyParams) -> list[dict[str, Any]]:
    """Kubernetes objects for Istio: fairlane's Deployment and Service, a Gateway and a
    VirtualService with one named route per rendered route, and the EnvoyFilter that patches
    the ingress gateway with the rendered ext_proc filter, clusters and settings."""
    names = kube_names(params)
    specs = _route_specs(params)
    routes = [rendered for rendered, _ in specs]
    hcm_match = {
        "context": "GATEWAY",
        "listener": {"filterChain": {"filter": {"name": HCM_FILTER}}},
    }
    patches: list[dict[str, Any]] = [
        {
            "applyTo": "HTTP_FILTER",
            "match": {
                "context": "GATEWAY",
                "listener": {
                    "filterChain": {
                        "filter": {"name": HCM_FILTER, "subFilter": {"name": ROUTER_FILTER}}
                    }
                },
            },
            "patch": {"operation": "INSERT_BEFORE", "value": scoped_ext_proc_filter(params)},
        },
        {
            "applyTo": "NETWORK_FILTER",
            "match": hcm_match,
            "patch": {
                "operation": "MERGE",
                "value": {
                    "name": HCM_FILTER,
                    "typed_config": {"@type": HCM_TYPE, **hcm_settings(params)},
                },
            },
        },
        {
            "applyTo": "LISTENER",
            "match": {"context": "GATEWAY"},
            "patch": {
                "operation": "MERGE",
                "value": {"per_connection_buffer_limit_bytes": params.buffer_limit_bytes},
            },
        },
        {
            "applyTo": "CLUSTER",
            "match": {"context": "GATEWAY"},
            "patch": {"operation": "ADD", "value": extproc_cluster(params)},
        },
        {
            "applyTo": "CLUSTER",
            "match": {
                "context": "GATEWAY",
                "cluster": {"service": names.vllm_host, "portNumber": names.backend_port},
            },
            "patch": {"operation": "MERGE", "value": backend_cluster_merge(params)},
        },
        *(
            {
                "applyTo": "HTTP_ROUTE",
                "match": {
                    "context": "GATEWAY",
                    "routeConfiguration": {"vhost": {"route": {"name": rendered["name"]}}},
                },
                "patch": {"operation": "MERGE", "value": enabling_route_merge(rendered, allow)},
            }
            for rendered, allow in specs
        ),
    ]
    gateway = {
        "apiVersion": ISTIO_API,
        "kind": "Gateway",
        "metadata": {"name": GATEWAY, "namespace": names.namespace},
        "spec": {
            "selector": {"istio": "ingressgateway"},
            "servers": [
                {"port": {"number": 80, "name": "http", "protocol": "HTTP"}, "hosts": ["*"]}
            ],
        },
    }
    http_routes = []
    for rendered in routes:
        kind, value = next(iter(rendered["match"].items()))
        http_routes.append(
            {
                "name": rendered["name"],  # the HTTP_ROUTE patches match this name
                "match": [{"uri": {"prefix" if kind == "prefix" else "exact": value}}],
                "route": [
                    {
                        "destination": {
                            "host": names.vllm_host,
                            "port": {"number": names.backend_port},
                        }
                    }
                ],
                "timeout": rendered["route"]["timeout"],
                "retries": {
                    "attempts": rendered["route"]["retry_policy"]["num_retries"],
                    "retryOn": rendered["route"]["retry_policy"]["retry_on"],
                },
            }
        )
    virtual_service = {
        "apiVersion": ISTIO_API,
        "kind": "VirtualService",
        "metadata": {"name": "llm", "namespace": names.namespace},
        "spec": {"hosts": ["*"], "gateways": [GATEWAY], "http": http_routes},
    }
    envoy_filter = {
        "apiVersion": ISTIO_API,
        "kind": "EnvoyFilter",
        "metadata": {"name": "fairlane-ext-proc", "namespace": "istio-system"},
        "spec": {
            "workloadSelector": {"labels": {"istio": "ingressgateway"}},
            "configPatches": patches,
        },
    }
    return [*_workload(params, names), gateway, virtual_service, envoy_filter]


def _gateway_api_duration(seconds: float) -> str:
    """Gateway API Duration (``^([0-9]{1,5}(h|m|s|ms)){1,4}$``): whole seconds, else ms."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def render_envoy_gateway(params: EnvoyParams) -> list[dict[str, Any]]:
    """Kubernetes objects for Envoy Gateway: fairlane's Deployment and Service, an EnvoyProxy
    with the completion feed (ALS), the Gateway, one HTTPRoute + EnvoyExtensionPolicy per
    rendered route (failOpen per route), a BackendTrafficPolicy (override_host routing,
    retries, circuit breakers, health checks) and a ClientTrafficPolicy (buffer, idle)."""
    names = kube_names(params)
    filter_config = ext_proc_filter(params)["typed_config"]
    mode = filter_config["processing_mode"]
    backend = backend_cluster(params)
    check = backend["health_checks"][0]
    outlier = backend["outlier_detection"]
    fairlane_ref = {"name": names.service, "port": params.extproc_port}
    proxy = {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "EnvoyProxy",
        "metadata": {"name": "fairlane-proxy", "namespace": names.namespace},
        "spec": {
            "telemetry": {
                "accessLog": {
                    "settings": [
                        {
                            "sinks": [
                                {
                                    "type": "ALS",
                                    "als": {
                                        "backendRefs": [fairlane_ref],
                                        "type": "HTTP",
                                        "logName": _als_log_name(params),
                                    },
                                }
                            ]
                        }
                    ]
                }
            }
        },
    }
    gateway = {
        "apiVersion": f"{GATEWAY_API}/v1",
        "kind": "Gateway",
        "metadata": {"name": GATEWAY, "namespace": names.namespace},
        "spec": {
            "gatewayClassName": "eg",
            "infrastructure": {
                "parametersRef": {
                    "group": "gateway.envoyproxy.io",
                    "kind": "EnvoyProxy",
                    "name": "fairlane-proxy",
                }
            },
            "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}],
        },
    }
    client_policy = {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "ClientTrafficPolicy",
        "metadata": {"name": "fairlane-client", "namespace": names.namespace},
        "spec": {
            "targetRefs": [{"group": GATEWAY_API, "kind": "Gateway", "name": GATEWAY}],
            "connection": {"bufferLimit": str(params.buffer_limit_bytes)},
            "timeout": {
                "http": {"streamIdleTimeout": _gateway_api_duration(params.stream_idle_timeout_s)}
            },
        },
    }
    objects: list[dict[str, Any]] = [*_workload(params, names), proxy, gateway, client_policy]
    route_refs = []
    for rendered, allow in _route_specs(params):
        name = kube_name(rendered["name"])
        kind, value = next(iter(rendered["match"].items()))
        route_refs.append({"group": GATEWAY_API, "kind": "HTTPRoute", "name": name})
        objects.append(
            {
                "apiVersion": f"{GATEWAY_API}/v1",
                "kind": "HTTPRoute",
                "metadata": {"name": name, "namespace": names.namespace},
                "spec": {
                    "parentRefs": [{"name": GATEWAY}],
                    "rules": [
                        {
                            "matches": [
                                {
                                    "path": {
                                        "type": "PathPrefix" if kind == "prefix" else "Exact",
                                        "value": value,
                                    }
                                }
                            ],
                            "backendRefs": [{"name": VLLM_SERVICE, "port": names.backend_port}],
                        }
                    ],
                },
            }
        )
        objects.append(
            {
                "apiVersion": ENVOY_GATEWAY_API,
                "kind": "EnvoyExtensionPolicy",
                "metadata": {"name": name, "namespace": names.namespace},
                "spec": {
                    "targetRefs": [{"group": GATEWAY_API, "kind": "HTTPRoute", "name": name}],
                    "extProc": [
                        {
                            "backendRefs": [fairlane_ref],
                            "processingMode": {
                                # request present = request headers SEND; no `response`:
                                # response headers and body are skipped
                                "request": {"body": _EG_BODY_MODES[mode["request_body_mode"]]}
                            },
                            # no max_message_timeout in Envoy Gateway: the hold must fit here
                            "messageTimeout": _gateway_api_duration(
                                max(params.longest_hold_s, params.message_timeout_s)
                            ),
                            "failOpen": allow,
                            "metadata": {
                                "writableNamespaces": list(
                                    filter_config["metadata_options"]["receiving_namespaces"][
                                        "untyped"
                                    ]
                                )
                            },
                        }
                    ],
                },
            }
        )
    objects.append(
        {
            "apiVersion": ENVOY_GATEWAY_API,
            "kind": "BackendTrafficPolicy",
            "metadata": {"name": "fairlane-backends", "namespace": names.namespace},
            "spec": {
                "targetRefs": route_refs,
                "loadBalancer": {
                    # the fallback when no listed endpoint is usable, as in the bootstrap
                    "type": "LeastRequest",
                    "endpointOverride": {"extractFrom": [{"header": DESTINATION_HEADER}]},
                },
                "retry": {
                    "numRetries": NUM_RETRIES,
                    "retryOn": {"triggers": RETRY_ON.split(",")},
                },
                "circuitBreaker": {
                    "maxConnections": BACKEND_MAX_REQUESTS,
                    "maxPendingRequests": BACKEND_MAX_REQUESTS,
                    "maxParallelRequests": BACKEND_MAX_REQUESTS,
                    "maxParallelRetries": BACKEND_MAX_RETRIES,
                },
                "timeout": {
                    "http": {"requestTimeout": route_merge(route(params))["route"]["timeout"]}
                },
                "healthCheck": {
                    "active": {
                        "type": "HTTP",
                        "http": {"path": check["http_health_check"]["path"]},
                        "interval": check["interval"],
                        "timeout": check["timeout"],
                        "unhealthyThreshold": check["unhealthy_threshold"],
                        "healthyThreshold": check["healthy_threshold"],
                    },
                    "passive": {
                        "consecutive5XxErrors": outlier["consecutive_5xx"],
                        "consecutiveGatewayErrors": outlier["consecutive_gateway_failure"],
                        "interval": outlier["interval"],
                        "baseEjectionTime": outlier["base_ejection_time"],
                        "maxEjectionPercent": outlier["max_ejection_percent"],
                    },
                },
            },
        }
    )
    return objects


def _als_log_name(params: EnvoyParams) -> str:
    log: str = hcm_settings(params)["access_log"][0]["typed_config"]["common_config"]["log_name"]
    return log


class _NoAliases(yaml.SafeDumper):
    """Writes a dict used twice (the Deployment's labels) twice, not as ``&id001``/``*id001``:
    Kubernetes accepts anchors, but people reading or pasting the objects should not meet them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_mesh_yaml(params: EnvoyParams, mesh: str, generated_by: str) -> str:
    """The objects for ``mesh`` as one multi-document YAML with its header comment."""
    if mesh == "istio":
        header, objects = ISTIO_HEADER, render_istio(params)
    elif mesh == "envoy-gateway":
        header, objects = ENVOY_GATEWAY_HEADER, render_envoy_gateway(params)
    else:
        raise EnvoyConfigError(f"unknown mesh {mesh!r}: one of {', '.join(MESHES)}")
    comment = "".join(
        f"# {line}".rstrip() + "\n" for line in f"{generated_by}\n\n{header}".splitlines()
    )
    body = yaml.dump_all(
        objects, Dumper=_NoAliases, sort_keys=False, default_flow_style=False, width=100
    )
    return comment + "---\n" + body


def proto_merge(base: Any, patch: Any) -> Any:
    """Protobuf merge semantics on proto3-JSON dicts, as Istio's MERGE applies a patch:
    messages merge field by field, repeated fields append, scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = proto_merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list):
        return [*base, *patch]
    return patch


def istio_bootstrap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole bootstrap: the EnvoyFilter's patches applied to a stand-in for what Istio
    generates for the gateway from the VirtualService (a listener whose HCM ends in the
    router, routes named like the VirtualService's with Istio's default retry predicate, and
    the vLLM Service's outbound cluster with ``lb_policy: LEAST_REQUEST`` and static
    endpoints instead of EDS). ``envoy --mode validate`` on it shows that every patch value
    is config Envoy accepts where Istio puts it."""
    by_kind = {obj["kind"]: obj for obj in objects}
    patches = by_kind["EnvoyFilter"]["spec"]["configPatches"]

    def patch_values(apply_to: str, operation: str) -> list[dict[str, Any]]:
        return [
            p["patch"]["value"]
            for p in patches
            if p["applyTo"] == apply_to and p["patch"]["operation"] == operation
        ]

    deployment = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    backends = [urlsplit(arg.split("=", 2)[2]) for arg in deployment if arg.startswith("--backend")]
    virtual_service = by_kind["VirtualService"]["spec"]
    destination = virtual_service["http"][0]["route"][0]["destination"]
    outbound = f"outbound|{destination['port']['number']}||{destination['host']}"
    route_patches = {
        p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"]
        for p in patches
        if p["applyTo"] == "HTTP_ROUTE"
    }
    routes = []
    for http in virtual_service["http"]:
        (uri,) = http["match"]
        kind, value = next(iter(uri["uri"].items()))
        istio_route = {
            "name": http["name"],
            "match": {"prefix" if kind == "prefix" else "path": value},
            "route": {
                "cluster": outbound,
                "timeout": http["timeout"],
                "retry_policy": {
                    "retry_on": http["retries"]["retryOn"],
                    "num_retries": http["retries"]["attempts"],
                    "retry_host_predicate": [
                        {
                            "name": "envoy.retry_host_predicates.previous_hosts",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.retry.host."
                                "previous_hosts.v3.PreviousHostsPredicate"
                            },
                        }
                    ],
                    "host_selection_retry_max_attempts": 5,
                },
            },
        }
        routes.append(proto_merge(istio_route, route_patches.get(http["name"], {})))
    hcm: dict[str, Any] = {
        "@type": HCM_TYPE,
        "stat_prefix": "outbound_0.0.0.0_8080",
        "route_config": {
            "name": "http.8080",
            "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            *patch_values("HTTP_FILTER", "INSERT_BEFORE"),
            {
                "name": ROUTER_FILTER,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    for value in patch_values("NETWORK_FILTER", "MERGE"):
        hcm = proto_merge(hcm, value["typed_config"])
    listener: dict[str, Any] = {
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
        "filter_chains": [{"filters": [{"name": HCM_FILTER, "typed_config": hcm}]}],
    }
    for value in patch_values("LISTENER", "MERGE"):
        listener = proto_merge(listener, value)
    vllm: dict[str, Any] = {
        "name": outbound,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": outbound,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": url.hostname,
                                        "port_value": url.port,
                                    }
                                }
                            }
                        }
                        for url in backends
                    ]
                }
            ],
        },
    }
    for value in patch_values("CLUSTER", "MERGE"):
        vllm = proto_merge(vllm, value)
    return {
        "static_resources": {
            "listeners": [listener],
            "clusters": [*patch_values("CLUSTER", "ADD"), vllm],
        }
    }
