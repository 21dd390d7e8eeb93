"""A simulated vLLM 0.32 server: per-step engine, OpenAI API, vLLM's metrics.

One concept per module: ``profiles`` (how long one engine step takes on a real GPU),
``blocks`` (the KV block pool with prefix caching), ``engine`` (the per-step scheduler; no
I/O), ``fastforward`` (runs of identical decode-only steps in closed form), ``metrics``
(vLLM's Prometheus metrics), ``runner`` (drives the engine on a sped-up wall clock),
``request`` and ``response`` (parsing, validation errors, response and SSE shapes), ``lora``
(LoRA adapters), ``tokenize`` (vLLM's ``POST /tokenize``), ``kv_events`` and ``kv_publisher``
(the KV events), ``server`` (the aiohttp application), ``cli`` (``fairlane sim``) and
``capacity`` (a benchmark of the simulator itself).
"""
