"""The serving process's two listeners: one Django ASGI handler per URLconf.

The public listener (`inference.urls`) answers /v1/*; the internal one (`inference.internal_urls`)
answers /internal/load and is bound to loopback, so a request can reach the weight loader only
from this machine, whatever the public port exposes. A request resolves only in its listener's
URLconf: /internal/load on the public port is a 404.

Both run a short middleware chain, every link of it async-capable: the web app's chain has sync-only
links (WhiteNoise), and one sync link makes Django run every request through its single
sync thread, one request at a time, whatever the views are. This API needs none of the
browser middleware (sessions, CSRF, messages): its callers send bearer keys.

Per-request CPU in this process is taken from vLLM's engine core on a small machine, so a request
makes no thread hop it does not need: Django's async path runs each MiddlewareMixin hook, the
request_started signal and the response's close on a sync thread (six hops a request), inside a
ThreadSensitiveContext that starts a thread per request. Here the security and common middleware
(header and redirect logic, no I/O) run on the event loop, and so do the request signals (their
receivers only close this thread's unused database connections and reset the URLconf); the views'
database work (a key not in the cache) still runs on Django's sync thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from django.conf import settings
from django.middleware.common import CommonMiddleware as DjangoCommonMiddleware
from django.middleware.security import SecurityMiddleware as DjangoSecurityMiddleware

from core.asgi import LoopSignalsHandler
from core.bodylimit import BodyLimit, Scope, header_values
from inference.apis import MAX_BODY_BYTES, internal_token_valid

PUBLIC_URLS = "inference.urls"
INTERNAL_URLS = "inference.internal_urls"
MIDDLEWARE = (
    "core.metrics.RequestMetricsMiddleware",
    "inference.background_apis.LiveRequestsMiddleware",  # live requests first: background rollouts wait
    "inference.listeners.SecurityMiddleware",
    "inference.listeners.CommonMiddleware",
)


class _OnTheLoop:
    """MiddlewareMixin's async call with its hooks run inline instead of on a sync thread (two
    thread hops a request each): for middleware whose hooks do no I/O."""

    async def __acall__(self, request):
        response = self.process_request(request)
        response = response or await self.get_response(request)
        return self.process_response(request, response)


class SecurityMiddleware(_OnTheLoop, DjangoSecurityMiddleware):
    """django.middleware.security.SecurityMiddleware, its hooks on the event loop."""


class CommonMiddleware(_OnTheLoop, DjangoCommonMiddleware):
    """django.middleware.common.CommonMiddleware, its hooks on the event loop."""


class ListenerHandler(LoopSignalsHandler):
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


def _internal_credentialed(scope: Scope) -> bool:
    sent = b"".join(header_values(scope, b"authorization")[:1]).decode("latin-1")
    return internal_token_valid(sent.removeprefix("Bearer ").strip())


def listener_app(urlconf: str) -> BodyLimit:
    """The listener for `urlconf` with its body limit (core/bodylimit.py): the public one reads
    at most a completion request's bound; the internal one a push's, and only with its token."""
    handler = ListenerHandler(urlconf)
    if urlconf == INTERNAL_URLS:
        return BodyLimit(handler, limit=settings.FLYWHEEL_PUSH_MAX_BYTES,
                         anonymous_limit=settings.ANONYMOUS_MAX_BODY_BYTES, credentialed=_internal_credentialed)
    return BodyLimit(handler, limit=MAX_BODY_BYTES, anonymous_limit=settings.ANONYMOUS_MAX_BODY_BYTES)


class _SecondServer(uvicorn.Server):
    # The first server owns the signals; this one stops when it does (see Listeners.serve).
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Listeners:
    """The public and the internal listener of a serving process. `serve` runs both until the
    public one stops, then stops the other; on the main thread the public one stops on SIGINT or
    SIGTERM (uvicorn's own handlers). On another thread's loop (the engine's: no hop between a
    request and the engine) uvicorn cannot take the signals: the main thread calls `stop`."""

    def __init__(self, host: str, port: int, internal_host: str, internal_port: int) -> None:
        self.internal = _SecondServer(uvicorn.Config(listener_app(INTERNAL_URLS), host=internal_host,
                                                     port=internal_port, log_level="warning", lifespan="off"))
        self.public = uvicorn.Server(uvicorn.Config(listener_app(PUBLIC_URLS), host=host, port=port,
                                                    log_level="warning", lifespan="off"))

    async def serve(self) -> None:
        task = asyncio.create_task(self.internal.serve())
        try:
            await self.public.serve()
        finally:
            self.internal.should_exit = True
            await task

    def stop(self) -> None:
        """Both stop after their requests in flight (uvicorn reads the flag on its loop)."""
        self.public.should_exit = True

