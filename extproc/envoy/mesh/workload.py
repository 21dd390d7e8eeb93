"""fairlane's own workload in Kubernetes: one Deployment, or a StatefulSet of replicas.

One service runs as a Deployment of one pod behind the Service ``service.host`` names (its
queues and counters are that process's). Replicas (``service.replicas: N`` with
``service.state``, the Redis they share) run as a StatefulSet of N pods, because Envoy must
reach each pod at an address of its own: every replica gets every completion over a cluster
holding just that replica (``extproc.envoy.replicas``). One ClusterIP Service per pod,
selecting its ``statefulset.kubernetes.io/pod-name`` label, gives each a stable name that
works in both meshes, and each pod's ``--replica-id`` is its pod name. The pod list is static
(scaling is a new render), and the Redis is the cluster's own: nothing here deploys one.
"""

from __future__ import annotations

from typing import Any

from extproc.envoy.mesh import FAIRLANE_IMAGE, METRICS_PORT, KubeNames
from extproc.envoy.params import EnvoyParams
from extproc.envoy.replicas import pod_service_host
from extproc.fleet.backend import backend_argument

POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
"""The label Kubernetes sets on each StatefulSet pod, to its pod name."""


def workload(params: EnvoyParams, names: KubeNames) -> list[dict[str, Any]]:
    """fairlane's Deployment and Service, or with replicas its StatefulSet, Service and one
    Service per pod. The backends are the deployment's, by IP."""
    if params.replicated:
        return [
            _statefulset(params, names),
            _service(params, names.service, names, _labels(names)),
            *_pod_services(params, names),
        ]
    return [_deployment(params, names), _service(params, names.service, names, _labels(names))]


def pod_service_names(params: EnvoyParams, names: KubeNames) -> list[str]:
    """The per-pod Services' names, in replica order (empty without replicas)."""
    if not params.replicated:
        return []
    return [
        pod_service_host(params.extproc_host, ordinal).split(".", 1)[0]
        for ordinal in range(len(params.service_replicas))
    ]


def _labels(names: KubeNames) -> dict[str, str]:
    return {"app": names.service}


def _args(params: EnvoyParams) -> list[str]:
    args = [
        "serve",
        "--host=0.0.0.0",
        f"--port={params.extproc_port}",
        f"--metrics-port={METRICS_PORT}",
        *(f"--backend={backend_argument(b)}" for b in params.backends),
        # A headless vLLM Service: the service follows its pods through DNS; the mesh's own
        # control plane gives Envoy the same pods (the mesh owns its Envoys' EDS).
        *(f"--backend={backend_argument(d)}" for d in params.dns_backends),
    ]
    if params.service_tokenizer is not None:
        args.append(f"--tokenizer={params.service_tokenizer}")
    if params.replicated:
        # $(POD_NAME) is expanded by Kubernetes from the container's env (below)
        args += [f"--state={params.state_url}", "--replica-id=$(POD_NAME)"]
    return args


def engine_keys_secret(names: KubeNames) -> str:
    """The Secret the engines' API keys are read from: one key per ``env:NAME`` the
    backends name (the operator creates it; the keys never pass through the renderer)."""
    return f"{names.service}-engine-keys"


def _engine_key_env(params: EnvoyParams, names: KubeNames) -> list[dict[str, Any]]:
    """The container's environment for the backends' ``env:NAME`` keys, from the Secret
    ``engine_keys_secret``; a ``file:PATH`` key is the operator's own volume mount."""
    references = [b.credential for b in params.backends]
    references += [d.credential for d in params.dns_backends]
    wanted = sorted(
        {r.removeprefix("env:") for r in references if r is not None and r.startswith("env:")}
    )
    secret = engine_keys_secret(names)
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}}
        for name in wanted
    ]


def _pod_template(params: EnvoyParams, names: KubeNames) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "fairlane",
        "image": FAIRLANE_IMAGE,
        "args": _args(params),
        "ports": [
            {"name": "grpc", "containerPort": params.extproc_port},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
    }
    env = _engine_key_env(params, names)
    if params.replicated:
        env.insert(
            0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        )
    if env:
        container["env"] = env
    return {
        "metadata": {
            "labels": _labels(names),
            # plain h2c from the gateway, plain HTTP to the vLLM pods' /metrics
            "annotations": {"sidecar.istio.io/inject": "false"},
        },
        "spec": {"containers": [container]},
    }


def _deployment(params: EnvoyParams, names: KubeNames) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.service, "namespace": names.namespace},
        "spec": {
            "replicas": 1,  # queues and fairness counters are per process
            "selector": {"matchLabels": _labels(names)},
            "template": _pod_template(params, names),
        },
    }


def _statefulset(params: EnvoyParams, names: KubeNames) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": names.service, "namespace": names.namespace},
        "spec": {
            # the replicas share their state in Redis (service.state); one per pod Service
            "replicas": len(params.service_replicas),
            "serviceName": names.service,
            # replicas are peers: start and replace them all at once, not one by one
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(names)},
            "template": _pod_template(params, names),
        },
    }


def _service(
    params: EnvoyParams, name: str, names: KubeNames, selector: dict[str, str]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": names.namespace},
        "spec": {
            "selector": selector,
            "ports": [
                {
                    "name": "grpc",
                    "port": params.extproc_port,
                    "targetPort": params.extproc_port,
                    "appProtocol": "kubernetes.io/h2c",
                },
                {"name": "http-metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT},
            ],
        },
    }


def _pod_services(params: EnvoyParams, names: KubeNames) -> list[dict[str, Any]]:
    """One Service per StatefulSet pod: the address Envoy reaches that replica at."""
    return [
        _service(params, name, names, {**_labels(names), POD_NAME_LABEL: name})
        for name in pod_service_names(params, names)
    ]
