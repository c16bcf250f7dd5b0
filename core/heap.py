"""A long-lived process's startup heap, marked permanent once it has loaded (`gc.freeze`).

Python's cyclic collector walks every object of its oldest generation on a full collection. A
web process holds about 475,000 tracked objects once its views are imported (Django, DRF, torch,
transformers and PEFT through the apps), a serving process more (vLLM's frontend beside them);
none of them is garbage. An ingest batch of 1,000 events allocates about 60,000 containers, so
full collections kept coming. Measured in the web process (uvicorn) over 20,000 ingested events:
the collector took 0.60 s of CPU, one full collection 271 ms on an ingest thread holding the GIL;
with the startup heap frozen, 0.04 s and no full collection. vLLM's API server and engine core
freeze theirs after their start too (`freeze_gc_heap`), and so do Celery workers
(webapp/celery.py).

Objects made after the freeze are collected as before. A frozen object that later becomes
cyclic garbage is kept: only what exists at start-up is frozen, which is loaded once."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any


def freeze_startup_heap(urlconfs: Iterable[str | None] = (None,)) -> None:
    """Loads the URLconfs `urlconfs` (None: the site's), collects what start-up left as garbage,
    then freezes the rest (`gc.get_freeze_count()` says how many: it walks them, so it is not
    called here).

    Django imports a URLconf, its views and all they import on the first request: in the web
    process that is most of the heap (transformers, PEFT and the training app through the
    views: 210,000 objects), which would be left unfrozen and walked by every full collection."""
    from django.urls import get_resolver

    for urlconf in urlconfs:
        get_resolver(urlconf).url_patterns  # noqa: B018 - the import is the point
    gc.collect()
    gc.freeze()


async def lifespan(scope: dict[str, Any], receive, send) -> None:
    """The ASGI lifespan protocol: the heap is frozen at the server's startup (after the app and
    its imports loaded, before the first request)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            freeze_startup_heap()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
