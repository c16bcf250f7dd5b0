"""ASGI entry point: HTTP goes to Django, WebSockets to Channels consumers.

    .venv/bin/uvicorn webapp.asgi:application --port 8000
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()

from django.conf import settings  # noqa: E402

from core import dbthreads  # noqa: E402
from core.asgi import LoopSignalsHandler  # noqa: E402
from core.bodylimit import BodyLimit  # noqa: E402
from core.heap import lifespan  # noqa: E402
from webapp.consumers import StoreGuard  # noqa: E402
from webapp.routing import websocket_urlpatterns  # noqa: E402

INGEST_PATH = "/api/v1/events"


class IngestHandler(LoopSignalsHandler):
    """Django, with the same middleware and URLs, for the ingest endpoint: its middleware chain is
    loaded sync and runs, view included, in one hop to the ingest database threads
    (core.dbthreads, whose connections persist). Loaded async, as for every other path, each
    middleware's hooks and the view would hop to a thread of their own: 16 hops a request, about
    a third of what a batch of 100 events cost the web server. The request signals and the
    response's close run on the event loop (core.asgi): two hops fewer."""

    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)
        chain = self._middleware_chain

        async def in_db_thread(request):
            return await dbthreads.arun("ingest", settings.INGEST_DB_THREADS, lambda: chain(request))

        self._middleware_chain = in_db_thread


def by_path(default, paths: dict):
    """HTTP requests to one of `paths` (the path Django resolves: behind a proxy's prefix, the
    part after `root_path`) go to its app; every other request (and scope) to `default`."""

    async def app(scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        target = paths.get(path) if scope["type"] == "http" else None
        await (target or default)(scope, receive, send)

    return app


http_application = (by_path(django_application, {INGEST_PATH: IngestHandler()}) if settings.INGEST_DB_THREADS
                    else django_application)

application = ProtocolTypeRouter(
    {
        # Bodies bounded before Django reads (and spools) them: core/bodylimit.py.
        "http": BodyLimit(http_application, limit=settings.REQUEST_MAX_BODY_BYTES,
                          anonymous_limit=settings.ANONYMOUS_MAX_BODY_BYTES),
        "websocket": StoreGuard(AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
        # At the server's startup the loaded heap is frozen: full collections skip it (core/heap.py).
        "lifespan": lifespan,
    }
)
