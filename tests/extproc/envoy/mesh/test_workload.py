"""fairlane's workload in Kubernetes: one Deployment, or a StatefulSet of replicas with a
Service per pod; a mesh refuses replicas it cannot run that way."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.envoy.mesh import kube_names
from extproc.envoy.mesh.workload import POD_NAME_LABEL, pod_service_names, workload
from extproc.envoy.params import EnvoyConfigError, EnvoyParams
from extproc.envoy.replicas import statefulset_replicas
from extproc.fleet.backend import BackendSpec, KVEventPorts

HOST = "fairlane.llm.svc.cluster.local"
STATE = "redis://redis.llm.svc.cluster.local:6379"
PODS = (BackendSpec("10.0.0.11", 8000, "a"), BackendSpec("10.0.0.12", 8000, "a"))


def kinds(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


def test_one_service_is_one_deployment_with_no_redis() -> None:
    params = EnvoyParams(extproc_host=HOST, backends=PODS)
    objects = workload(params, kube_names(params))
    assert kinds(objects) == [("Deployment", "fairlane"), ("Service", "fairlane")]
    (container,) = objects[0]["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith(("--state", "--replica-id"))]
    assert pod_service_names(params, kube_names(params)) == []


def test_replicas_are_a_statefulset_with_a_service_per_pod() -> None:
    params = EnvoyParams(
        extproc_host=HOST,
        extproc_replicas=statefulset_replicas(HOST, 50051, 3),
        state_url=STATE,
        backends=PODS,
    )
    objects = workload(params, kube_names(params))
    assert kinds(objects) == [
        ("StatefulSet", "fairlane"),
        ("Service", "fairlane"),
        ("Service", "fairlane-0"),
        ("Service", "fairlane-1"),
        ("Service", "fairlane-2"),
    ]
    statefulset = objects[0]["spec"]
    assert statefulset["replicas"] == 3
    (container,) = statefulset["template"]["spec"]["containers"]
    assert f"--state={STATE}" in container["args"]
    assert "--replica-id=$(POD_NAME)" in container["args"]
    for ordinal, service in enumerate(objects[2:]):
        assert service["spec"]["selector"][POD_NAME_LABEL] == f"fairlane-{ordinal}"
    # the per-pod Services are the hosts Envoy reaches the replicas at
    assert [
        f"{n}.llm.svc.cluster.local" for n in pod_service_names(params, kube_names(params))
    ] == [r.host for r in params.service_replicas]


def test_a_mesh_needs_replicas_by_count_and_their_redis() -> None:
    listed = EnvoyParams(
        extproc_host=HOST, extproc_replicas=(("a", 50051), ("b", 50051)), state_url=STATE
    )
    with pytest.raises(EnvoyConfigError, match="as a count"):
        kube_names(listed)
    no_state = EnvoyParams(extproc_host=HOST, extproc_replicas=statefulset_replicas(HOST, 50051, 2))
    with pytest.raises(EnvoyConfigError, match=r"service\.state"):
        kube_names(no_state)


def test_the_service_gets_each_backends_seats_and_key_reference_and_env_keys_from_a_secret() -> (
    None
):
    backends = (
        BackendSpec("10.0.0.11", 8000, "a", seats=64, credential="env:VLLM_KEY_A"),
        BackendSpec("10.0.0.12", 8000, "b", credential="file:/keys/b"),
        BackendSpec("10.0.0.13", 8000, "a", credential="env:VLLM_KEY_A"),
    )
    params = EnvoyParams(extproc_host=HOST, backends=backends)
    (container,) = workload(params, kube_names(params))[0]["spec"]["template"]["spec"]["containers"]
    assert [a for a in container["args"] if a.startswith("--backend")] == [
        "--backend=a=http://10.0.0.11:8000#seats=64,key=env:VLLM_KEY_A",
        "--backend=b=http://10.0.0.12:8000#key=file:/keys/b",
        "--backend=a=http://10.0.0.13:8000#key=env:VLLM_KEY_A",
    ]
    # The key itself is never rendered: the variable comes from a Secret the operator made.
    assert container["env"] == [
        {
            "name": "VLLM_KEY_A",
            "valueFrom": {"secretKeyRef": {"name": "fairlane-engine-keys", "key": "VLLM_KEY_A"}},
        }
    ]


def test_the_service_gets_kv_event_ports_and_the_models_tokenizer() -> None:
    backends = (BackendSpec("10.0.0.11", 8000, "a", kv_events=KVEventPorts(5557, 5558)),)
    params = EnvoyParams(extproc_host=HOST, backends=backends, service_tokenizer="/models/m")
    (container,) = workload(params, kube_names(params))[0]["spec"]["template"]["spec"]["containers"]
    assert "--backend=a=http://10.0.0.11:8000#kv-events=5557,kv-replay=5558" in container["args"]
    assert "--tokenizer=/models/m" in container["args"]
