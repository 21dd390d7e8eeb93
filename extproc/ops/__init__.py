"""Operating fairlane: the ``fairlane`` command, ``fairlane up``, ``check`` and child processes."""
