"""``fairlane bench overhead``: what the gateway itself costs, Envoy with vs without fairlane.

``direct`` (Envoy alone) and one or more fairlane arms (Envoy with the ext_proc filter and
one service process, each with its policy: ``fairlane`` gate-free, ``fairlane-default`` the
shipped default) against an instant backend, in wall-clock time: saturation (closed loop),
fixed rates and half the arm's capacity (open loop), concurrency 1, and for the fairlane
arms the overload at twice their capacity and the recovery after it; beside them, when
named, the peer gateways vllm-router and LiteLLM in place of both. One concept per module:
``scenario`` (the ``kind: overhead`` file), ``wire`` (HTTP/1.1 framing), ``backend`` (the
instant backend), ``loadgen`` (the load generator, each response classified), ``eventloop``
(uvloop), ``phase`` (one phase's figures; the recovery rule), ``rates``, ``driver`` (one
arm's phases), ``runner`` (the arms; ``results.json``), ``verdicts``, ``gateways`` (every
arm's whole gateway against the backend alone), ``report``, ``plots``, and ``floor`` (a
servicer that decides nothing, behind the same Envoy). ``python -m loadtests.bench.overhead``
is the same run with the older flags; in ``loadtests.bench`` only the command's dispatch imports it.
"""
