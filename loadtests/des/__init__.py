"""fairlane at scale as a discrete-event simulation: the real core on a virtual clock.

One machine cannot run 1,000 engines and 100,000 tenants as processes, but the gateway's
decisions are plain Python with no I/O (``extproc.core``), and the simulator's engine is a
per-step model with no clock (``loadtests.sim.engine``). Here both run on one virtual clock,
driven by an event heap, with no socket and no sleep. The modules: ``clock`` (the event heap),
``engines`` (the simulator's engines on the virtual clock), ``envoy`` (what Envoy does around
a pick), ``gateway`` (fairlane's real core and the CPU each call costs), ``workload``
(heavy-tailed tenants, a diurnal day, power users, batch jobs), ``model`` (a ``kind: des``
scenario file), ``run`` (one simulation), ``report`` (results.json, report.md, the cost plot),
``ab`` (an A/B bench scenario's fairlane arm as a simulation) and ``crosscheck`` (that
simulation against the real arm). ``fairlane bench scale-smoke`` runs one
(``loadtests/scenarios/scale-*.yaml``); ``python -m loadtests.des.crosscheck batch-flood``
cross-checks one against the real run.
"""
