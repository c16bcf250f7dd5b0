"""The serving process's two listeners: one Django ASGI handler per URLconf.

The public listener (`inference.urls`) answers /v1/*; the internal one (`inference.internal_urls`)
answers /internal/load and is bound to loopback, so a request can reach the weight loader only
from this machine, whatever the public port exposes. A request resolves only in its listener's
URLconf: /internal/load on the public port is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from django.core.handlers.asgi import ASGIHandler

PUBLIC_URLS = "inference.urls"
INTERNAL_URLS = "inference.internal_urls"


class ListenerHandler(ASGIHandler):
    """Django's ASGI handler with its own URLconf (Django resolves `request.urlconf` first)."""

    def __init__(self, urlconf: str) -> None:
        super().__init__()
        self.urlconf = urlconf

    def create_request(self, scope, body_file):
        request, error = super().create_request(scope, body_file)
        if request is not None:
            request.urlconf = self.urlconf
        return request, error


class _SecondServer(uvicorn.Server):
    # The first server owns the signals; this one stops when it does (see serve_both).
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_both(host: str, port: int, internal_host: str, internal_port: int) -> None:
    """Runs both listeners until the public one stops (SIGINT/SIGTERM), then stops the other."""
    internal = _SecondServer(uvicorn.Config(ListenerHandler(INTERNAL_URLS), host=internal_host, port=internal_port,
                                            log_level="warning", lifespan="off"))
    public = uvicorn.Server(uvicorn.Config(ListenerHandler(PUBLIC_URLS), host=host, port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(internal.serve())
    try:
        await public.serve()
    finally:
        internal.should_exit = True
        await task
