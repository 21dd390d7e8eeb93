"""``fairlane bench``: run a load scenario against FIFO and fairlane in one go, and report.

The modules, one concern each: ``scenario`` (the YAML model and its validation),
``workload`` (the seeded request schedule), ``client`` (the asyncio load generator),
``arms`` (starting and stopping each arm's processes), ``cpu`` (per-process CPU
accounting), ``report`` (statistics, targets, report.md/results.json), ``cli`` (the
command).
"""
