"""``fairlane bench overhead``: what the gateway itself costs, Envoy with vs without fairlane.

Two arms (``direct``: Envoy alone; ``fairlane``: Envoy with the ext_proc filter and one
service process) against the same instant backend, each driven open loop at fixed rates and
closed loop at saturation, in wall-clock time. One concept per module:

- ``scenario``   the ``kind: overhead`` scenario file (rates, phases, targets)
- ``wire``       HTTP/1.1 framing shared by both ends
- ``backend``    the instant backend (``python -m loadtests.bench.overhead.backend``)
- ``loadgen``    the open/closed-loop load generator
- ``eventloop``  uvloop for both
- ``phase``      one phase's measurement and its reported numbers
- ``verdicts``   the targets PASS/FAIL, suspect when the harness was the bottleneck
- ``plots``      the PNG plots
- ``report``     ``report.md``
- ``runner``     starting, driving and stopping the arms; ``results.json``

``python -m loadtests.bench.overhead`` is the same run with the older command-line flags.
Nothing else in ``loadtests.bench`` imports this package, except the command's dispatch.
"""
