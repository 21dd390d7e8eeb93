"""Envoy's side: the bootstrap, the snippet for existing meshes, and the deployment file.

Everything here renders configuration or finds and runs the Envoy binary; nothing is on the
request path. One module per piece of Envoy config, so each setting sits next to its reason:
``params`` (``EnvoyParams``, the few numbers every setting is derived from); ``filter``,
``routes``, ``clusters``, ``connection_manager`` and ``overload`` (the pieces); ``bootstrap``,
``snippet`` and ``mesh`` (the whole config, the pieces for an existing Envoy, Istio or Envoy
Gateway objects); ``protojson`` and ``generated`` (recurring proto3-JSON shapes, how files
are written); ``binary`` (finding Envoy, ``envoy --mode validate``); ``deployment`` and
``render`` (``fairlane render-envoy``). The names the service and the config must agree on
(cluster names, the destination header, metadata namespaces) live in ``extproc.wire``, below
both, so the codec and the renderer cannot drift apart.
"""
