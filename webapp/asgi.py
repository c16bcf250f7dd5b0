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

from core.bodylimit import BodyLimit  # noqa: E402
from webapp.consumers import StoreGuard  # noqa: E402
from webapp.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Bodies bounded before Django reads (and spools) them: core/bodylimit.py.
        "http": BodyLimit(django_application, limit=settings.REQUEST_MAX_BODY_BYTES,
                          anonymous_limit=settings.ANONYMOUS_MAX_BODY_BYTES),
        "websocket": StoreGuard(AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
    }
)
