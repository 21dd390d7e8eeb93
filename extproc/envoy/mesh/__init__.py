"""Other meshes: fairlane's Envoy config delivered the way Istio and Envoy Gateway take it.

``fairlane render-envoy --mesh istio|envoy-gateway`` renders Kubernetes objects instead of an
Envoy bootstrap: the same ext_proc filter, clusters, route settings and HCM settings, but as
Istio takes them (an EnvoyFilter, ``extproc.envoy.mesh.istio``) or as Envoy Gateway does
(Gateway API and its policies, ``extproc.envoy.mesh.envoy_gateway``). Everything Envoy-side
comes from the builders in ``extproc/envoy/``, so the meshes cannot drift from the bootstrap
(``tests/deploy/test_mesh_snippets.py`` checks both). This module holds what both share:
where fairlane runs in Kubernetes, the rendered routes with their failure modes, and
``render_mesh_yaml``; fairlane's own workload is ``extproc.envoy.mesh.workload``. The typed
check and ``envoy --mode validate`` stay with the command (``extproc/envoy/render.py``),
which imports this package; nothing here imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from extproc.envoy.generated import comment
from extproc.envoy.params import EnvoyConfigError, EnvoyParams, RouteSpec
from extproc.envoy.replicas import is_kube_service_host, statefulset_replicas
from extproc.envoy.routes import route

MESHES = ("istio", "envoy-gateway")
VLLM_SERVICE = "vllm"
"""The Kubernetes Service in front of the vLLM pods (rename it in the rendered file)."""
GATEWAY = "llm-gateway"
FAIRLANE_IMAGE = "fairlane:dev"
METRICS_PORT = 9090


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
    of fairlane, which the mesh renders name and namespace from. Replicas must be the pods of
    its StatefulSet (``service.replicas: N``): the workload the mesh renders is that."""
    if not is_kube_service_host(params.extproc_host):
        raise EnvoyConfigError(
            "a mesh config needs service.host = NAME.NAMESPACE.svc.cluster.local (fairlane's "
            f"Kubernetes Service), got {params.extproc_host!r}"
        )
    parts = params.extproc_host.split(".")
    if params.replicated:
        count = len(params.service_replicas)
        pods = statefulset_replicas(params.extproc_host, params.extproc_port, count)
        if params.service_replicas != pods:
            raise EnvoyConfigError(
                "a mesh config runs replicas as a StatefulSet: give service.replicas as a "
                f"count ({count}), not a list of addresses"
            )
        if not params.state_url:
            raise EnvoyConfigError(
                "replicas share their state in Redis: set service.state to its "
                "redis://HOST:PORT URL (a Redis the cluster runs)"
            )
    ports = {b.port for b in params.backends} | {d.port for d in params.dns_backends}
    if len(ports) != 1:
        raise EnvoyConfigError(
            f"the backends must share one port (the vLLM pods' port), got {sorted(ports)}"
        )
    return KubeNames(parts[0], parts[1], ports.pop())


def route_merge(rendered_route: dict[str, Any]) -> dict[str, Any]:
    """What a mesh merges into its own route: the rendered route without name, match and
    cluster (the mesh's route names the cluster and matches the path)."""
    merged = {k: v for k, v in rendered_route.items() if k not in ("name", "match")}
    merged["route"] = {k: v for k, v in rendered_route["route"].items() if k != "cluster"}
    return merged


def route_specs(params: EnvoyParams) -> list[tuple[dict[str, Any], bool]]:
    """Each rendered route with its failure mode (fail-open or not), catch-all last."""
    specs: list[RouteSpec | None] = [*params.routes, None]
    return [
        (
            route(params, spec),
            params.failure_mode_allow if spec is None else spec.failure_mode_allow,
        )
        for spec in specs
    ]


class _NoAliases(yaml.SafeDumper):
    """Writes a dict used twice (the Deployment's labels) twice, not as ``&id001``/``*id001``:
    Kubernetes accepts anchors, but people reading or pasting the objects should not meet them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_mesh_yaml(params: EnvoyParams, mesh: str, generated_by: str) -> str:
    """The objects for ``mesh`` as one multi-document YAML with its header comment."""
    # imported here, not at the top: both modules import the shared names above from this
    # package, so a top-level import would be circular
    from extproc.envoy.mesh.envoy_gateway import ENVOY_GATEWAY_HEADER, render_envoy_gateway
    from extproc.envoy.mesh.istio import ISTIO_HEADER, render_istio

    if mesh == "istio":
        header, objects = ISTIO_HEADER, render_istio(params)
    elif mesh == "envoy-gateway":
        header, objects = ENVOY_GATEWAY_HEADER, render_envoy_gateway(params)
    else:
        raise EnvoyConfigError(f"unknown mesh {mesh!r}: one of {', '.join(MESHES)}")
    body = yaml.dump_all(
        objects, Dumper=_NoAliases, sort_keys=False, default_flow_style=False, width=100
    )
    return comment(f"{generated_by}\n\n{header}") + "---\n" + body
