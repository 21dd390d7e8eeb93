"""A loopback HTTP server that stands in for a backend behind the real Envoy in tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_every_path(
    handler: Handler, port: int, max_body_bytes: int = 1024**2
) -> web.AppRunner:
    """Answer every method and path on 127.0.0.1:``port`` with ``handler``; the caller
    cleans up the returned runner."""
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner
