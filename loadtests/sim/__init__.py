"""A simulated vLLM 0.32 server: per-step engine, OpenAI API, vLLM's metrics.

Layout, one concept per module:

- ``profiles``  step-time models (how long one engine step takes on a real GPU)
- ``blocks``    the KV block pool with prefix caching
- ``engine``    the per-step scheduler (waiting queue, running batch, preemption); no I/O
- ``fastforward`` runs of identical decode-only steps in closed form, exact against ``engine``
- ``metrics``   vLLM's Prometheus metrics, fed from engine events
- ``runner``    drives the engine on a (sped-up) wall clock
- ``request``   request parsing and vLLM's validation errors
- ``lora``      LoRA adapters: ``--lora-modules``, the runtime load/unload routes' checks
- ``response``  response bodies, SSE chunk shapes and error bodies
- ``server``    the aiohttp application
- ``cli``       ``fairlane sim``
- ``capacity``  a benchmark of the simulator itself
"""
