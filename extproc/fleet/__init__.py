"""The fleet: each vLLM backend's state, and the poller that keeps it fresh.

``backend`` holds what the gateway knows about an engine (health, in-flight requests, seats,
the last scraped metrics) without any I/O, so the core can read it in tests; ``poller`` is
the only module here that talks HTTP; ``vllm_metrics`` parses vLLM's Prometheus text and
``seats`` learns how many requests an engine runs at once. ``kv_events`` is what an engine
says its prefix cache holds (its KV events, decoded), ``kv_subscriber`` the only module
here that talks ZMQ (following those events), ``tokenizer`` the served model's tokenizer
and chat template (for the block hashes the events name).
"""
