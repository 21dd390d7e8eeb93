"""The deployment file's ``service:`` section: where Envoy reaches the ext_proc service.

One service (``{host, port}``, the default), or active-active replicas sharing state in Redis,
each at an address of its own: Envoy sends every completion to every replica over a cluster
holding just that one (``extproc.envoy.replicas``). In Kubernetes the replicas are a
StatefulSet of N pods, each reached at a Service of its own, which the mesh renderers write.
A single name that resolves to every replica (a headless Service, a compose service scaled
with ``deploy.replicas``) cannot be used: its completion feed would reach one replica only.
The list is static: scaling means rendering again with the new count. ``read_service``
shows each shape.
"""

from __future__ import annotations

from typing import Any

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from extproc.envoy.params import ServiceReplica
from extproc.envoy.replicas import is_kube_service_host, statefulset_replicas
from extproc.yamlfile import LocatedReader

SERVICE_KEYS = ("host", "port", "replicas", "state")
_REPLICA_KEYS = ("host", "port")
DEFAULT_PORT = 50051


def _port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else f"must be in [1, 65535], got {value}"


def _host(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


def _state(value: str) -> str | None:
    return None if value.startswith("redis://") else "must be a redis://HOST:PORT[/DB] URL"


def read_service(reader: LocatedReader, node: Node) -> dict[str, Any]:
    """``EnvoyParams`` fields from the ``service:`` mapping (problems go to ``reader``).

    One service (today's shape, and the default)::

        service: {host: 127.0.0.1, port: 50051}

    Active-active replicas sharing state in Redis (``fairlane serve --state URL --replica-id
    NAME``), each at an address of its own; ``port`` is the default of the replicas that name
    none, ``state`` the Redis they share (the mesh renderers put it on the service's command
    line; Envoy never uses it)::

        service:
          port: 50051
          state: redis://redis:6379
          replicas:
            - {host: fairlane-1}
            - {host: fairlane-2}
            - {host: 10.0.0.7, port: 50052}

    In Kubernetes, a StatefulSet of N pods behind fairlane's Service, by count: each pod is
    reached at a Service of its own, ``NAME-i.NAMESPACE.svc...`` for i in 0..N-1, which the mesh
    renderers write (one per pod, selected by the ``statefulset.kubernetes.io/pod-name``
    label)::

        service: {host: fairlane.llm.svc.cluster.local, port: 50051, replicas: 3,
                  state: "redis://redis.llm.svc.cluster.local:6379"}
    """
    fields = reader.mapping(node, "service", SERVICE_KEYS)
    found: dict[str, Any] = {}
    if "host" in fields:
        found["extproc_host"] = reader.value(fields["host"], "service.host", str, _host)
    if "port" in fields:
        found["extproc_port"] = reader.value(fields["port"], "service.port", int, _port)
    if "state" in fields:
        found["state_url"] = reader.value(fields["state"], "service.state", str, _state)
    if "replicas" in fields:
        port = found.get("extproc_port") or DEFAULT_PORT
        replicas = _read_replicas(reader, fields["replicas"], found.get("extproc_host"), port)
        if replicas is not None:
            found["extproc_replicas"] = replicas
    return {key: value for key, value in found.items() if value is not None}


def _read_replicas(
    reader: LocatedReader, node: Node, host: str | None, port: int
) -> tuple[ServiceReplica, ...] | None:
    if isinstance(node, ScalarNode):
        count = reader.value(
            node, "service.replicas", int, lambda v: None if v >= 1 else "must be >= 1"
        )
        if count is None:
            return None
        if host is None or not is_kube_service_host(host):
            reader.error(
                node,
                "service.replicas",
                "a count needs service.host = NAME.NAMESPACE.svc.cluster.local (a StatefulSet "
                "behind that Service, one Service per pod); elsewhere list the replicas: "
                "[{host, port}, ...]",
            )
            return None
        return statefulset_replicas(host, port, count) if count > 1 else ()
    if not isinstance(node, SequenceNode) or not node.value:
        reader.error(
            node, "service.replicas", "must be a count or a non-empty list of {host, port}"
        )
        return None
    replicas: list[ServiceReplica] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(node.value):
        path = f"service.replicas[{index}]"
        fields = reader.mapping(item, path, _REPLICA_KEYS)
        if not isinstance(item, MappingNode):
            continue
        if "host" not in fields:
            reader.error(item, f"{path}.host", "is required (each replica's own address)")
            continue
        name = reader.value(fields["host"], f"{path}.host", str, _host)
        own = reader.value(fields["port"], f"{path}.port", int, _port) if "port" in fields else port
        if name is None or own is None:
            continue
        replica = ServiceReplica(name, own)
        if replica.address in seen:
            reader.error(
                item,
                path,
                f"{replica.address} is already service.replicas[{seen[replica.address]}]",
            )
            continue
        seen[replica.address] = index
        replicas.append(replica)
    return tuple(replicas)
