"""The I/O edge of the service: gRPC servicers, the codec, the server and Prometheus.

``codec`` is the only module that touches ext_proc protobuf. ``servicer`` turns Envoy's
streams into core events and back, ``held`` owns the futures of requests Envoy holds while
they wait in a queue, ``overload`` measures how far behind the service is and ``runtime``
holds the layer Envoy reads over RTDS (the share it turns away), ``server`` wires the
process together, and ``prometheus`` exposes the core's counters. ``h2grpc`` is the gRPC
server the servicers run on, in the event loop's thread, and ``http2`` its HTTP/2 framing.
"""
