"""fairlane's ext_proc service: classify, hold, prioritise and route LLM requests for Envoy.

Where things live (one concept per module):

- ``cli``        the ``fairlane`` command and its sub-commands
- ``messages``   plain request/decision objects that cross the protobuf boundary
- ``codec``      the only module that touches ext_proc protobuf
- ``service``    the thin grpc.aio servicer
- ``errors``     OpenAI-shaped client errors
- ``prompt``     chat rendering and the cheap deterministic tokenizer shared with the simulator
- ``processes``  starting and always stopping child processes
"""

__version__ = "0.1.0"
