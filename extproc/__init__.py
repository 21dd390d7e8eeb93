"""fairlane's ext_proc service: classify, hold, prioritise and route LLM requests for Envoy.

Where things live (one package per concern; docs/development/architecture.md has the
module table and one request's path through them):

- ``core``       every per-request decision, synchronous and free of I/O
- ``policy``     the YAML policy: model, whole-file validation, the store
- ``fleet``      the backends' state; ``fleet.poller`` is its only HTTP
- ``transport``  gRPC servicers, the protobuf codec, held requests, the server, Prometheus
- ``envoy``      rendering Envoy's bootstrap, snippet, mesh objects; the deployment file
- ``ops``        the ``fairlane`` command, ``fairlane up``, ``check``, child processes
- ``wire``       the names the service and Envoy's config must agree on
- ``yamlfile``   hand-edited YAML read with ``file:line`` errors
"""

__version__ = "0.1.0"
