"""Where shared state lives: in-process by default, Redis for replicas.

Alone (``fairlane serve`` without ``--state``), a service keeps everything in its own
memory and nothing here runs. With ``--state redis://HOST:PORT[/DB]`` it is one of N
active-active replicas: ``exchange`` (one atomic Lua script, one round trip) writes this
replica's report and reads the others' every ``period_s``, and ``replica`` applies what it
read to admission (``extproc.core.peers`` says how the decisions use it).
"""
