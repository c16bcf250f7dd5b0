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

from webapp.consumers import StoreGuard  # noqa: E402
from webapp.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_application,
        "websocket": StoreGuard(AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
    }
)
