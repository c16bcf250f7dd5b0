"""The startup heap is frozen when a server starts (core/heap.py): full collections then skip
the objects every process loads once."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite runs as it did


def _lifespan(app) -> list[str]:
    inbox: asyncio.Queue = asyncio.Queue()
    sent: list[str] = []

    async def send(message):
        sent.append(message["type"])

    async def run():
        await inbox.put({"type": "lifespan.startup"})
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send), 10)

    asyncio.run(run())
    return sent


def test_the_web_app_freezes_its_heap_at_startup(unfrozen):
    from webapp.asgi import application

    assert gc.get_freeze_count() == 0
    assert _lifespan(application) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert gc.get_freeze_count() > 10_000  # Django, DRF and the apps' imports


def test_objects_made_after_the_freeze_are_still_collected(unfrozen):
    from core.heap import freeze_startup_heap

    freeze_startup_heap()
    assert gc.get_freeze_count() > 0

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    assert ref() is None


def test_the_url_modules_are_imported_before_the_freeze(unfrozen):
    import sys

    from core.heap import freeze_startup_heap

    sys.modules.pop("tests.core.heap_urls", None)
    freeze_startup_heap(("tests.core.heap_urls",))
    # Django would import it (and its views, and all they import) on the first request: after
    # the freeze, unfrozen, walked by every full collection.
    assert "tests.core.heap_urls" in sys.modules
