"""Peer gateways as arms of ``fairlane bench``: what fairlane is compared with.

The gateways a platform team could run instead of fairlane, installed from PyPI into venvs
of their own (``scripts/setup-peers``) and started in front of the same engines as every
other arm. One concept per module:

- ``install``      where each peer is installed; :class:`PeerMissing` says why it is not
- ``kinds``        the peer arm kinds (which gateway, which policy, what clients send)
- ``served``       what each engine serves and its block size, asked of the engine
- ``vllm_router``  vllm-router's command line and start
- ``litellm``      the LiteLLM proxy's config, command line, start and priority range
- ``start``        starting a peer arm's gateway in front of the engines
- ``report``       what the report says about the peer arms that ran
"""
