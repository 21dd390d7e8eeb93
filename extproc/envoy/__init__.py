"""Envoy's side: the bootstrap, the snippet for existing meshes, and the deployment file.

Everything here renders configuration or finds and runs the Envoy binary; nothing is on the
request path. One module per piece of Envoy config, so each setting sits next to its reason:

* ``params``: :class:`EnvoyParams`, the few numbers every setting is derived from, and limits;
* ``filter``, ``routes``, ``clusters``, ``connection_manager``: the pieces; ``overload``:
  the runtime layer from the service and the shed twin in front of each route;
* ``bootstrap`` (the whole config) and ``snippet`` (the pieces for an existing Envoy) put
  them together; ``mesh`` delivers them as Istio or Envoy Gateway objects;
* ``protojson`` and ``generated``: the recurring proto3-JSON shapes and how files are written;
* ``binary``: finding Envoy, starting it, ``envoy --mode validate``;
* ``deployment`` and ``render``: ``fairlane render-envoy``, from a deployment file.

The names the service and the config must agree on (cluster names, the destination header,
metadata namespaces) live in :mod:`extproc.wire`, below both, so the codec and the renderer
cannot drift apart.
"""
