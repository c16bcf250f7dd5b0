"""webapp/asgi.py: the ingest path goes to its own handler, with or without a proxy's prefix, and
its request signals make no thread hop."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from django.core import signals

from feedback.models import Trajectory
from tests.factories import sign, trajectory
from webapp.asgi import by_path


def _routed(scope: dict) -> str:
    seen: list[str] = []

    def app(name: str):
        async def call(scope, receive, send):
            seen.append(name)
        return call

    asyncio.run(by_path(app("default"), {"/api/v1/events": app("ingest")})(scope, None, None))
    return seen[0]


def test_the_ingest_path_is_routed_to_its_handler_behind_a_prefix_too():
    assert _routed({"type": "http", "path": "/api/v1/events"}) == "ingest"
    assert _routed({"type": "http", "path": "/flywheel/api/v1/events", "root_path": "/flywheel"}) == "ingest"
    assert _routed({"type": "http", "path": "/api/v1/events/other"}) == "default"
    assert _routed({"type": "websocket", "path": "/api/v1/events"}) == "default"


@pytest.mark.django_db(transaction=True)
def test_an_ingest_request_sends_its_signals_once_each_on_the_event_loop_and_stores_the_batch(creds):
    from core.dbthreads import close_all
    from webapp.asgi import application

    seen: list[tuple[str, int]] = []

    def started(**kwargs):
        seen.append(("started", threading.get_ident()))

    def finished(**kwargs):
        seen.append(("finished", threading.get_ident()))

    body = json.dumps({"events": [trajectory("t-signals")]}).encode()
    headers = {**sign(creds.webhook_secret, body), "flywheel-project": creds.project.slug,
               "content-type": "application/json", "content-length": str(len(body))}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/v1/events", "raw_path": b"/api/v1/events", "root_path": "", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8000)}
    sent: list[dict] = []

    async def call() -> int:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        await application(scope, receive, send)
        return threading.get_ident()

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        loop_thread = asyncio.run(call())
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)
        close_all()  # the ingest threads' connections, before the database is flushed
    assert sent[0]["status"] == 202, sent
    assert seen == [("started", loop_thread), ("finished", loop_thread)]  # no thread hop for either
    assert Trajectory.objects.filter(project=creds.project, external_id="t-signals").exists()
