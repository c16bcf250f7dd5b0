"""The serving listeners (inference/listeners.py) run Django's ASGI request handling with two thread
hops taken out (core/asgi.py's handler, compared with Django's in tests/core/test_asgi.py), their
own URLconf and a short middleware chain."""

from __future__ import annotations

import httpx
import pytest
from django.conf import settings
from django.core import signals

from inference.listeners import PUBLIC_URLS, listener_app
from tests.processes import InThreadServer


def test_building_a_listener_leaves_the_web_apps_middleware_as_it_was():
    before = list(settings.MIDDLEWARE)
    listener_app(PUBLIC_URLS)
    assert list(settings.MIDDLEWARE) == before
    assert "django.contrib.sessions.middleware.SessionMiddleware" in before


@pytest.mark.django_db(transaction=True)
def test_a_request_sends_request_started_and_request_finished_once_each_and_runs_the_listeners_chain():
    seen: list[str] = []

    def started(**kwargs):
        seen.append("started")

    def finished(**kwargs):
        seen.append("finished")

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    server = InThreadServer(listener_app(PUBLIC_URLS))
    try:
        response = httpx.get(server.url + "/internal/load")  # the internal URLconf's: not on this listener
    finally:
        server.stop()
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)
    assert response.status_code == 404
    assert seen == ["started", "finished"]
    assert response.headers["x-content-type-options"] == "nosniff"  # the security middleware ran
    assert "set-cookie" not in response.headers and "cookie" not in response.headers.get("vary", "").lower()
