"""The deployment file's ``service:`` section: one address, a list of replicas, or a
StatefulSet by count; every problem named with its line."""

from __future__ import annotations

import pytest

from extproc.envoy.deployment import DeploymentError, parse_deployment
from extproc.envoy.params import EnvoyParams, ServiceReplica

BACKENDS = "backends: [{url: http://10.0.0.1:8000}]\n"


def params(service: str) -> EnvoyParams:
    return parse_deployment(BACKENDS + service, "d.yaml").params


def errors(service: str) -> list[str]:
    with pytest.raises(DeploymentError) as caught:
        parse_deployment(BACKENDS + service, "d.yaml")
    return caught.value.errors


def test_one_service_as_before() -> None:
    found = params("service: {host: fairlane, port: 50052}\n")
    assert found.service_replicas == (ServiceReplica("fairlane", 50052),)
    assert not found.replicated and found.state_url is None


def test_listed_replicas_take_the_sections_port_unless_they_name_one() -> None:
    found = params(
        "service:\n"
        "  port: 50052\n"
        "  state: redis://redis:6379\n"
        "  replicas: [{host: fairlane-1}, {host: fairlane-2, port: 6000}, {host: 10.0.0.9}]\n"
    )
    assert found.service_replicas == (
        ServiceReplica("fairlane-1", 50052),
        ServiceReplica("fairlane-2", 6000),
        ServiceReplica("10.0.0.9", 50052),
    )
    assert found.replicated and found.state_url == "redis://redis:6379"


def test_a_count_is_a_statefulsets_pods_each_at_its_own_service() -> None:
    found = params("service: {host: fairlane.llm.svc.cluster.local, replicas: 3}\n")
    assert [r.address for r in found.service_replicas] == [
        f"fairlane-{i}.llm.svc.cluster.local:50051" for i in range(3)
    ]
    one = params("service: {host: fairlane.llm.svc.cluster.local, replicas: 1}\n")
    assert one.service_replicas == (ServiceReplica("fairlane.llm.svc.cluster.local", 50051),)


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        (
            "service: {host: fairlane, replicas: 3}\n",
            "d.yaml:2: service.replicas: a count needs service.host = "
            "NAME.NAMESPACE.svc.cluster.local",
        ),
        ("service: {replicas: 0}\n", "d.yaml:2: service.replicas: must be >= 1"),
        ("service: {replicas: []}\n", "d.yaml:2: service.replicas: must be a count or"),
        ("service: {replicas: [{port: 1}]}\n", "d.yaml:2: service.replicas[0].host: is required"),
        (
            "service: {replicas: [{host: a}, {host: a}]}\n",
            "d.yaml:2: service.replicas[1]: a:50051 is already service.replicas[0]",
        ),
        ("service: {replicas: [{host: a, port: 0}]}\n", "d.yaml:2: service.replicas[0].port"),
        ("service: {state: http://redis}\n", "d.yaml:2: service.state: must be a redis://"),
        ("service: {hosts: [a]}\n", "d.yaml:2: service.hosts"),
    ],
)
def test_problems_are_named_with_their_line(service: str, expected: str) -> None:
    found = errors(service)
    assert any(e.startswith(expected) for e in found), found


def test_every_replica_problem_is_reported_at_once() -> None:
    found = errors(
        "service:\n"
        "  state: nope\n"  # line 3
        "  replicas:\n"
        "    - {host: a}\n"
        "    - {port: 3}\n"  # line 6
        "    - b\n"  # line 7
    )
    assert [e.split(":")[1] for e in found] == ["3", "6", "7"], found
