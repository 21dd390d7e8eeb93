"""fairlane at scale as a discrete-event simulation: the real core on a virtual clock.

A 2-core machine cannot run 1,000 engines and 100,000 tenants as processes, but the gateway's
decisions are plain Python with no I/O (``extproc.core``), and the simulator's engine is a
per-step model with no clock (``loadtests.sim.engine``). Here both run on one virtual
clock, driven by an event heap, with no socket and no sleep:

- ``clock``     the event heap and the virtual time every part reads
- ``engines``   the simulator's per-step vLLM engines, stepped on the virtual clock
- ``envoy``     what Envoy does around a pick, as a plain model (documented there)
- ``gateway``   fairlane's real core (policy, gateway, admission, picker, feedback), and
                the CPU time each of its calls costs
- ``workload``  heavy-tailed tenants, diurnal load, power users, batch jobs
- ``model``     a ``kind: des`` scenario file, validated
- ``run``       one simulation: wiring the parts, its results
- ``report``    results.json, report.md and the cost plot
- ``ab``        an A/B bench scenario's fairlane arm as a simulation (the bench's requests,
                policy, engine flags and statistics)
- ``crosscheck`` that simulation against the real arm, on the scenario's headline figures

``fairlane bench scale-smoke`` runs one (``loadtests/scenarios/scale-*.yaml``);
``python -m loadtests.des.crosscheck batch-flood`` cross-checks one against the real run.
"""
