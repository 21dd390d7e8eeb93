"""The service as active-active replicas: Envoy fails over between them and tells each one
every completion.

With ``EnvoyParams.extproc_replicas`` (``fairlane up --replicas N``, ``service.replicas`` in
a deployment file) the ext_proc cluster holds every replica and Envoy picks one per request
(one gRPC stream each). A dead replica must not fail the requests it does not hold: a stream
that cannot be opened is retried on another replica (``stream_retry_policy``), health checks
and outlier detection take a dead one out within milliseconds (``failover_settings``), and
each client key's streams go to one replica (``stream_hash_policy``) so a tenant's requests
meet in one queue. A replica that dies takes its held requests with it (Envoy answers them
503 with ``retry-after``); requests it had released to a backend are unaffected, since Envoy
carries them. Every replica gets every completion (``completion_clusters``), so each must be
reachable at an address of its own. With one replica nothing here applies: no health
checks, the completion feed on the ext_proc cluster itself.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from extproc.envoy.params import EnvoyParams, ServiceReplica
from extproc.envoy.protojson import previous_hosts
from extproc.wire import EXTPROC_CLUSTER

REPLICA_CLUSTER_PREFIX = f"{EXTPROC_CLUSTER}_replica_"
"""A replica's own cluster (its completion feed) is this plus its 1-based position."""

HEALTH_CHECK_INTERVAL_S = 1.0
"""How often Envoy connects to each replica; with one failure enough, a replica that stops
accepting connections is out of the rotation within about this long."""
EJECT_AFTER_LOCAL_FAILURES = 2
"""Consecutive connect failures or resets that eject a replica (one stray reset does not)."""
STREAM_RETRIES_MAX = 2
"""At most this many other replicas are tried for a stream that cannot be opened."""
STREAM_RETRY_ON = "connect-failure,refused-stream,reset,unavailable"
"""Failures before the replica's first answer: the request was not decided there."""
AFFINITY_HEADER = "x-fairlane-affinity"
"""A header of the ext_proc stream itself (never of the request) that Envoy hashes to pick
the replica: the client's key, set by :func:`stream_affinity_metadata`."""
AFFINITY_VALUE = "%REQ(x-fairlane-client-authorization?authorization)%%REQ(x-api-key)%"
"""The key as the filter sees it: the shipped bootstrap has moved ``authorization`` to
``x-fairlane-client-authorization`` (extproc.envoy.owned_headers), an existing Envoy has not;
``x-api-key`` is the other place a key may be. Requests with no key all get the same value,
so they meet on one replica too. The value is hashed as sent: a key sent as ``authorization``
and as ``x-api-key`` may land on two replicas."""


def replica_cluster_name(position: int) -> str:
    """The cluster of the ``position``-th replica (1-based, like ``--replica-id r1``)."""
    return f"{REPLICA_CLUSTER_PREFIX}{position}"


def completion_clusters(params: EnvoyParams) -> list[str]:
    """The clusters the completion feed goes to: one per replica, or the ext_proc cluster
    itself when there is only one.

    A request's completion frees the backend slot on the replica that admitted it, and Envoy
    cannot know which one that was (the access log is written after the ext_proc stream has
    closed). So there is one gRPC access logger per replica, each to a cluster holding just that
    replica, all with the same ``log_name``; a replica ignores completions of request ids it
    does not know. That is why a replica must be reachable at an address of its own, never only
    behind a name that resolves to all of them: a logger to such a cluster would send each
    completion to one replica only.
    """
    if not params.replicated:
        return [EXTPROC_CLUSTER]
    return [replica_cluster_name(i) for i in range(1, len(params.service_replicas) + 1)]


def discovery_type(replicas: tuple[ServiceReplica, ...]) -> str:
    """STATIC when every host is an IP address, else STRICT_DNS (which takes IPs too):
    Envoy re-resolves names, so a replica that comes back at a new address is followed."""
    for replica in replicas:
        try:
            ipaddress.ip_address(replica.host)
        except ValueError:
            return "STRICT_DNS"
    return "STATIC"


def failover_settings(params: EnvoyParams) -> dict[str, Any]:
    """Fields for the ext_proc cluster that move new requests off a dead replica: health
    checks, outlier detection, no panic routing. Empty with one replica.

    Active health checks, a TCP connect every second, one failure marks a replica down; outlier
    detection on local-origin errors (connect failures, resets, timeouts, counted apart from the
    service's answers) ejects a replica after two in a row, usually within milliseconds under
    load, without waiting for the next health check.
    """
    if not params.replicated:
        return {}
    return {
        # Each key's streams to one replica (stream_hash_policy).
        "lb_policy": "MAGLEV",
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": f"{HEALTH_CHECK_INTERVAL_S:g}s",
                # Envoy's default for a host without traffic is 60 s: a replica that got no
                # stream lately must still be found dead (or alive again) within a second.
                "no_traffic_interval": f"{HEALTH_CHECK_INTERVAL_S:g}s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                # The gRPC port accepting connections; a busy replica still accepts (the
                # kernel does), so load never fails the check, only a dead process does.
                "tcp_health_check": {},
            }
        ],
        "outlier_detection": {
            # Connect failures and resets are counted apart from the service's answers
            # (gRPC answers are HTTP 200 anyway).
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": EJECT_AFTER_LOCAL_FAILURES,
            "enforcing_consecutive_local_origin_failure": 100,
            # Success-rate ejection would compare replicas by how often their streams are
            # cut, which clients do (a disconnect while held): off.
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "5s",
            # Outliers never take out more than half the replicas; the health checks take
            # out every dead one, and panic routing is off (below).
            "max_ejection_percent": 50,
        },
        # By default, with under half the replicas healthy Envoy would spread requests over
        # all of them, dead ones included; only a live replica can answer.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def stream_affinity_metadata(params: EnvoyParams) -> list[dict[str, str]]:
    """The ext_proc ``GrpcService.initial_metadata`` that carries the client's key to the
    stream's headers, where the ext_proc cluster's hash policy reads it. Empty with one
    replica."""
    if not params.replicated:
        return []
    return [{"key": AFFINITY_HEADER, "value": AFFINITY_VALUE}]


def stream_hash_policy(params: EnvoyParams) -> dict[str, Any]:
    """Fields of the ext_proc cluster's ``HttpProtocolOptions`` that hash each stream on
    :data:`AFFINITY_HEADER`, for the cluster's Maglev (:func:`failover_settings`), so each
    key's streams go to one replica. A dead replica leaves the table at its first failed
    health check (panic routing is off), and a stream's retry takes another host (Maglev
    hashes again per attempt under the ``previous_hosts`` predicate). Empty with one
    replica.

    Each client key's streams go to one replica (Maglev over the key), so a tenant's requests
    meet in one queue, ranked there exactly as one process ranks them, and a conversation's
    turns find the prefix index that routed the earlier ones. Keys, not requests, spread over
    the replicas (pinned keys served the light tenants better than spread streams on
    ``power-user``: docs/benchmarks/internals.md); a key's replica that dies moves it to the
    next one Maglev picks, as the retry does.
    """
    if not params.replicated:
        return {}
    return {"hash_policy": [{"header": {"header_name": AFFINITY_HEADER}}]}


def stream_retry_policy(params: EnvoyParams) -> dict[str, Any] | None:
    """The ext_proc ``GrpcService.retry_policy`` (a ``config.core.v3.RetryPolicy``): a stream
    that cannot be opened on one replica is opened on another. None with one replica.

    Envoy's gRPC client runs the stream through its router, which retries before the first
    response headers on ``connect-failure``, ``refused-stream``, ``reset`` and gRPC
    ``unavailable``, on a host it has not tried (``previous_hosts``); the filter then buffers
    what it sent for the replay (it sets ``buffer_body_for_retry`` exactly when a retry policy
    is configured; Envoy's async client keeps at most the first 64 KiB of each stream, which
    holds the headers message that a replay needs, so the cost is bounded by 64 KiB per open
    stream). A replica that has answered once owns the stream: nothing after its first answer is
    ever replayed, so a request is never decided twice.
    """
    if not params.replicated:
        return None
    return {
        "retry_on": STREAM_RETRY_ON,
        "num_retries": min(STREAM_RETRIES_MAX, len(params.service_replicas) - 1),
        # Envoy's default back-off for this message starts at 1 s: far too slow when
        # another replica is ready now.
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        "retry_host_predicate": [previous_hosts()],
        "host_selection_retry_max_attempts": 5,
    }


def xds_retry_policy(params: EnvoyParams) -> dict[str, Any] | None:
    """How fast the runtime (RTDS) stream is opened again after its replica died (an
    ``EnvoyGrpc.retry_policy``); Envoy's default backs off up to 30 s, and a shed fraction
    from a dead replica would stay that long. None with one replica."""
    if not params.replicated:
        return None
    return {"retry_back_off": {"base_interval": "0.25s", "max_interval": "2s"}}


def is_kube_service_host(host: str) -> bool:
    """``NAME.NAMESPACE.svc[.DOMAIN]``: a Kubernetes Service's DNS name."""
    parts = host.split(".")
    return len(parts) >= 3 and parts[2] == "svc" and all(parts[:2])


def pod_service_host(service_host: str, ordinal: int) -> str:
    """The Service of one StatefulSet pod: ``fairlane.llm.svc.cluster.local`` and 2 give
    ``fairlane-2.llm.svc.cluster.local``, the Service that selects the pod ``fairlane-2`` by
    the ``statefulset.kubernetes.io/pod-name`` label Kubernetes puts on it
    (extproc.envoy.mesh.workload renders those Services)."""
    name, rest = service_host.split(".", 1)
    return f"{name}-{ordinal}.{rest}"


def statefulset_replicas(service_host: str, port: int, count: int) -> tuple[ServiceReplica, ...]:
    """The replicas of a StatefulSet of ``count`` pods behind ``service_host``, each at its
    own pod's Service (a name that resolves to every pod would not do: see
    ``completion_clusters``)."""
    return tuple(ServiceReplica(pod_service_host(service_host, i), port) for i in range(count))
