"""The two-model Kubernetes example (deploy/kubernetes/models/): valid against the Kubernetes
API schemas, offline, and consistent with its deployment file and the Envoy config it mounts.

What both examples share (valid manifests, a fresh and valid ``envoy.yaml`` mounted from
the kustomization's ConfigMap) is checked for both in ``test_kubernetes.py``; here, what
this one adds: one headless Service and one Deployment per model, the service's
``--backend`` flags are those Services' DNS names and ports with the models each
Deployment's pods serve (``--served-model-name`` and the ``--lora-modules`` names), exactly
as the deployment file's ``backends`` say.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy.deployment import load_deployment
from extproc.fleet.discovery import DnsBackendSpec, FleetSpec
from tests.deploy.conftest import REPO
from tests.deploy.manifests import Example, container

EXAMPLE = Example(REPO / "deploy" / "kubernetes" / "models")
ENGINES = {"vllm-llama": ("llama-8b", "sql", "law"), "vllm-qwen": ("qwen-7b",)}
"""Each engine Deployment (and its headless Service) and what its pods serve."""


def find(kind: str, name: str) -> dict[str, Any]:
    return EXAMPLE.find(kind, name)


def values_after(args: list[str], flag: str) -> list[str]:
    """``--flag=A`` or ``--flag A B ...`` (up to the next ``--``): the values given."""
    for index, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return [arg.split("=", 1)[1]]
        if arg == flag:
            rest = args[index + 1 :]
            end = next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))
            return rest[:end]
    return []


def served_by(args: list[str]) -> tuple[str, ...]:
    """What ``vllm serve ARGS`` answers to, in its /v1/models order: the served names (the
    model itself without ``--served-model-name``), then the LoRA adapters' names."""
    served = values_after(args, "--served-model-name") or [args[0]]
    adapters = [module.split("=", 1)[0] for module in values_after(args, "--lora-modules")]
    if adapters:
        assert "--enable-lora" in args  # vLLM refuses --lora-modules without it
    return (*served, *adapters)


def service_backends() -> FleetSpec:
    args = container(find("Deployment", "fairlane"), "fairlane")["args"]
    return FleetSpec.parse(a.removeprefix("--backend=") for a in args if a.startswith("--backend="))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_model_is_a_headless_service_of_its_own_pods(engine: str) -> None:
    """One pool per model: the Service lists only its Deployment's pods (the selectors do
    not overlap), which serve the model under the name clients send, with priority
    scheduling, and keep serving while the gateway drains them."""
    service = find("Service", engine)
    deployment = find("Deployment", engine)
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS lists every pod
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == labels == deployment["spec"]["selector"]["matchLabels"]
    for other in set(ENGINES) - {engine}:
        other_labels = find("Deployment", other)["spec"]["template"]["metadata"]["labels"]
        assert not service["spec"]["selector"].items() <= other_labels.items(), other
    (port,) = service["spec"]["ports"]
    vllm = container(deployment, "vllm")
    (engine_port,) = vllm["ports"]
    assert port["targetPort"] == engine_port["name"]
    assert f"--port={engine_port['containerPort']}" in vllm["args"]
    assert "--scheduling-policy=priority" in vllm["args"]
    assert served_by(vllm["args"]) == ENGINES[engine]
    spec = deployment["spec"]["template"]["spec"]
    sleep = vllm["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > sleep > 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_adapters_are_mounted_where_the_engine_reads_them() -> None:
    deployment = find("Deployment", "vllm-llama")
    vllm = container(deployment, "vllm")
    (mount,) = vllm["volumeMounts"]
    (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"] and mount["readOnly"]
    for module in values_after(vllm["args"], "--lora-modules"):
        path = Path(module.split("=", 1)[1])
        assert Path(mount["mountPath"]) in path.parents, module


def test_the_service_names_both_pools_with_their_models() -> None:
    """The service's ``--backend`` flags: each engine Service's DNS name and port, declaring
    what its pods serve; the deployment file's ``backends`` say exactly the same."""
    fleet = service_backends()
    assert not fleet.static
    expected = []
    for engine, models in ENGINES.items():
        service = find("Service", engine)
        (port,) = service["spec"]["ports"]
        name = f"{engine}.{service['metadata']['namespace']}.svc.cluster.local"
        expected.append((name, port["port"], models))
    assert sorted((d.name, d.port, d.models) for d in fleet.dns) == sorted(expected)
    assert len(fleet.regions) == 1  # a region is a failover level, not a model

    def described(specs: tuple[DnsBackendSpec, ...]) -> list[tuple[object, ...]]:
        return [(d.region, d.name, d.port, d.seats, d.credential, d.models) for d in specs]

    params = load_deployment(EXAMPLE.deployment).params
    assert not params.backends
    assert described(params.dns_backends) == described(fleet.dns)
    args = container(find("Deployment", "fairlane"), "fairlane")["args"]
    assert f"--port={params.extproc_port}" in args and params.extproc_host == "127.0.0.1"


def test_every_object_is_in_one_namespace_the_example_creates() -> None:
    objects = EXAMPLE.objects()
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    name = namespace["metadata"]["name"]
    others = [o for o in objects if o["kind"] != "Namespace"]
    assert {o["metadata"]["namespace"] for o in others} == {name}
    kustomization = yaml.safe_load(EXAMPLE.kustomization.read_text())
    (generated,) = kustomization["configMapGenerator"]
    assert generated["namespace"] == name
