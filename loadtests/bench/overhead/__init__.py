"""``fairlane bench overhead``: what the gateway itself costs, Envoy with vs without fairlane.

``direct`` (Envoy alone) and one or more fairlane arms (Envoy with the ext_proc filter and one
service process, each with its policy: ``fairlane`` gate-free, ``fairlane-default`` the
shipped default) against an instant backend, in wall-clock time: saturation (closed loop),
fixed rates and half the arm's capacity (open loop), concurrency 1, and for the fairlane
arms the overload at twice their capacity and the recovery after it. One concept per module:

- ``scenario``   the ``kind: overhead`` scenario file (arms, rates, phases, targets)
- ``wire``       HTTP/1.1 framing shared by both ends
- ``backend``    the instant backend (``python -m loadtests.bench.overhead.backend``)
- ``loadgen``    the open/closed-loop load generator; each response classified
- ``eventloop``  uvloop for both
- ``phase``      one phase's measurement and its reported numbers; the recovery rule
- ``verdicts``   the targets PASS/FAIL, suspect when the harness was the bottleneck
- ``plots``      the PNG plots
- ``report``     ``report.md``
- ``rates``      which open-loop rates each arm runs (``half_capacity`` resolved)
- ``driver``     one arm's phases in order, and the CPU taken over each
- ``runner``     starting and stopping the arms; ``results.json``
- ``floor``      the grpc.aio floor: a servicer that decides nothing, behind the same Envoy

``python -m loadtests.bench.overhead`` is the same run with the older command-line flags.
Nothing else in ``loadtests.bench`` imports this package, except the command's dispatch.
"""
