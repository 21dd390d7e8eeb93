"""Envoy's side: the bootstrap, the snippet for existing meshes, and the deployment file.

Everything here renders configuration or finds and runs the Envoy binary; nothing is on the
request path. The wire contract both sides must agree on (header names, metadata
namespaces, cluster names) has one home, so the codec and the renderer cannot drift apart.
"""
