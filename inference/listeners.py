"""The serving process's two listeners: one Django ASGI handler per URLconf.

The public listener (`inference.urls`) answers /v1/*; the internal one (`inference.internal_urls`)
answers /internal/load and is bound to loopback, so a request can reach the weight loader only
from this machine, whatever the public port exposes. A request resolves only in its listener's
URLconf: /internal/load on the public port is a 404.

Both run a short middleware chain, every link of it async-capable: the web app's chain has sync-only
links (WhiteNoise), and one sync link makes Django run every request through its single
sync thread, one request at a time, whatever the views are. This API needs none of the
browser middleware (sessions, CSRF, messages): its callers send bearer keys.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler

PUBLIC_URLS = "inference.urls"
INTERNAL_URLS = "inference.internal_urls"
MIDDLEWARE = (
    "core.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
)


class ListenerHandler(ASGIHandler):
    """Django's ASGI handler with its own URLconf (Django resolves `request.urlconf` first)."""

    def __init__(self, urlconf: str) -> None:
        super().__init__()
        self.urlconf = urlconf

    def load_middleware(self, is_async: bool = False) -> None:
        # Django reads the chain from settings.MIDDLEWARE only; swapped for the build, then restored.
        chain = settings.MIDDLEWARE
        settings.MIDDLEWARE = list(MIDDLEWARE)
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = chain

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
