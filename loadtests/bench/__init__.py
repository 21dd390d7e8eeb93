"""``fairlane bench``: run a load scenario against FIFO and fairlane in one go, and report.

The modules, one concern each, in the order a run uses them: ``scenario`` (the scenario
file, a package), ``policy_scale`` (``policy: default`` rescaled to the run's speedup),
``workload`` (the seeded request schedule), ``arms`` (each arm's processes;
``fifo_bootstrap``, the Envoy-only baseline's config; ``peers``, other gateways), ``client``
(the asyncio load generator and its records; ``request_style``, what an arm's clients add),
``cpu`` and ``cachestats`` (CPU per process, the fleet's prefix-cache hits), ``engine`` and
``pinning`` (real engines the bench starts, and which cores run what), ``guidellm`` (an
outside load generator next to the bench's client), ``replica_flows`` (which replica decided
which flow), ``stats``, ``targets`` and ``results`` (an arm's figures, the scenario's
targets, ``results.json``'s shape), ``report`` and ``plots``, ``cli`` (the command;
``frontier``, the chat-vs-batch frontier) and ``overhead`` (``fairlane bench overhead``, the
gateway's own cost).
"""
