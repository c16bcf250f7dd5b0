"""webapp/asgi.py: the ingest path goes to its own handler, with or without a proxy's prefix."""

from __future__ import annotations

import asyncio

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
