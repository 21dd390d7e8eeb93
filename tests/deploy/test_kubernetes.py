"""The Kubernetes examples (deploy/kubernetes/, and deploy/kubernetes/models/ with two
models): valid against the Kubernetes API schemas, offline, and consistent with the Envoy
config they mount. What only the two-model example has: ``test_kubernetes_models.py``.

No API server runs here, so nothing is applied: ``kubernetes-validate`` (a dev dependency,
from PyPI) checks every manifest against the OpenAPI schemas of the Kubernetes release it
ships (strict: unknown fields fail), and the tests cross-check what a cluster would need to
agree on: the rendered ``envoy.yaml`` is fresh and passes ``envoy --mode validate``, the
service follows the headless vLLM Service by its DNS name and port, the Envoy container
mounts the ConfigMap the kustomization makes from ``envoy.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.envoy.binary import validate
from extproc.envoy.deployment import load_deployment
from extproc.envoy.render import render
from extproc.fleet.discovery import FleetSpec
from extproc.wire import BACKEND_CLUSTER, EXTPROC_CLUSTER
from tests.deploy.conftest import REPO
from tests.deploy.manifests import Example, container

KUBE = REPO / "deploy" / "kubernetes"
SINGLE = Example(KUBE)
TWO_MODELS = Example(KUBE / "models")
EXAMPLES = pytest.mark.parametrize("example", [SINGLE, TWO_MODELS], ids=["single", "models"])
DEPLOYMENT = SINGLE.deployment
MANIFESTS = [path for example in (SINGLE, TWO_MODELS) for path in example.manifests]


def find(kind: str, name: str) -> dict[str, Any]:
    return SINGLE.find(kind, name)


@pytest.mark.parametrize("path", MANIFESTS, ids=[str(p.relative_to(KUBE)) for p in MANIFESTS])
def test_every_manifest_is_valid_kubernetes(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_mistake() -> None:
    """The check above can fail: a misspelt field is refused."""
    broken = find("Service", "vllm")
    broken["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


@EXAMPLES
def test_rendered_envoy_config_is_fresh(example: Example, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the header names the files relative to the working directory
    deployment = example.deployment.relative_to(REPO)
    config = example.envoy_config.relative_to(REPO)
    fresh = render(load_deployment(deployment)).text
    assert example.envoy_config.read_text() == fresh, (
        f"{config} is stale: fairlane render-envoy {deployment} -o {config}"
    )


@EXAMPLES
def test_rendered_envoy_config_validates(example: Example) -> None:
    validate(example.envoy_config)


def test_the_service_follows_the_headless_vllm_service() -> None:
    vllm_service = find("Service", "vllm")
    vllm = find("Deployment", "vllm")
    assert vllm_service["spec"]["clusterIP"] == "None"  # headless: DNS lists every pod
    assert vllm_service["spec"]["selector"] == vllm["spec"]["template"]["metadata"]["labels"]
    (port,) = vllm_service["spec"]["ports"]
    (engine_port,) = container(vllm, "vllm")["ports"]
    assert port["targetPort"] == engine_port["name"]
    assert "--scheduling-policy=priority" in container(vllm, "vllm")["args"]
    # a departing engine keeps serving while the gateway drains it
    spec = vllm["spec"]["template"]["spec"]
    sleep = container(vllm, "vllm")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > sleep > 5

    gateway = find("Deployment", "fairlane")
    args = container(gateway, "fairlane")["args"]
    fleet = FleetSpec.parse(
        a.removeprefix("--backend=") for a in args if a.startswith("--backend=")
    )
    namespace = vllm_service["metadata"]["namespace"]
    (name,) = fleet.dns
    assert not fleet.static
    assert name.name == f"vllm.{namespace}.svc.cluster.local" and name.port == port["port"]
    params = load_deployment(DEPLOYMENT).params
    assert [(d.region, d.name, d.port) for d in params.dns_backends] == [
        (name.region, name.name, name.port)
    ]
    assert f"--port={params.extproc_port}" in args and params.extproc_host == "127.0.0.1"


@EXAMPLES
def test_envoy_mounts_the_config_and_learns_the_backends_over_eds(example: Example) -> None:
    gateway = example.find("Deployment", "fairlane")
    envoy = container(gateway, "envoy")
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    (mount,) = envoy["volumeMounts"]
    config_path = envoy["args"][envoy["args"].index("-c") + 1]
    assert config_path == f"{mount['mountPath']}/{example.envoy_config.name}"
    (volume,) = gateway["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    kustomization = yaml.safe_load(example.kustomization.read_text())
    (generated,) = kustomization["configMapGenerator"]
    assert generated["name"] == volume["configMap"]["name"]
    assert generated["files"] == [example.envoy_config.name]
    assert sorted(kustomization["resources"]) == sorted(
        str(p.relative_to(example.directory)) for p in example.manifests
    )
    bootstrap = yaml.safe_load(example.envoy_config.read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    backends = clusters[BACKEND_CLUSTER]
    assert backends["type"] == "EDS"
    (source,) = backends["eds_cluster_config"]["eds_config"]["api_config_source"]["grpc_services"]
    assert source["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    (http,) = envoy["ports"]
    assert listener["port_value"] == http["containerPort"]
    service = example.find("Service", "fairlane")
    assert service["spec"]["selector"] == gateway["spec"]["template"]["metadata"]["labels"]


def test_the_readme_says_nothing_was_deployed() -> None:
    text = (KUBE / "README.md").read_text()
    assert "No API server" in text and "kubernetes-validate" in text
