"""The decision core: every per-request decision, as plain typed Python with no I/O.

Classification, the fair scheduler, gates, reservations, the picker and its prefix model,
the vLLM priority, admission, completion feedback, the overload control and the gateway's
decisions live here.
Nothing in this package imports asyncio, aiohttp, grpc or protobuf (a layer contract checks
it): the transport layer (``extproc.transport``) turns Envoy's streams into the events these
modules take, and owns every future and timer. One clock is injected, so tests and the
discrete-event simulator drive time themselves.
"""
