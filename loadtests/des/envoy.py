"""What Envoy does around fairlane's pick, as the simulation models it.

The pick is honoured: a forwarded request goes to the first endpoint the service listed, as
the ``override_host`` load balancer does. A request whose engine is down when it is sent, or
dies before the request sent anything to its client, is retried on the next listed endpoint
that is up until the list is used up (then the client gets a 503); a stream that already sent
tokens cannot be retried, and the client sees it cut. Regional failover is the picker's (its
alternates include other regions). Envoy's access log reaches the service
``feedback_delay_s`` after the last byte (``Knobs``). Not modelled: hedged requests (on a
fleet with free seats they rarely fire), connection pools, the ext_proc round trips' own
latency (measured for real by ``fairlane bench overhead``) and Envoy's CPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from loadtests.des.engines import EngineNode


def next_endpoint(
    endpoints: tuple[str, ...], tried: int, nodes: Mapping[str, EngineNode]
) -> tuple[int, EngineNode] | None:
    """The endpoint a try after ``tried`` earlier ones goes to: the next listed one that is
    up (a down one costs no try of the budget: Envoy's connect failure is immediate and the
    retry policy's host predicate skips it), or None when the list is used up."""
    for index in range(tried, len(endpoints)):
        node = nodes.get(endpoints[index])
        if node is not None and node.alive:
            return index, node
    return None
