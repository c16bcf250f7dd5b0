"""Django's ASGI handler without the thread hops its request signals make (`LoopSignalsHandler`).

Django's async path sends `request_started` and closes each response (which sends
`request_finished`) on a sync thread: two hops a request, inside a ThreadSensitiveContext that
starts a thread per request. Their receivers only reset the URLconf and close the calling
thread's unused database connections and caches, so here they run on the event loop. Used by the
serving listeners (inference/listeners.py) and the ingest endpoint (webapp/asgi.py), whose
database work runs on threads of its own (core/dbthreads.py).
"""

from __future__ import annotations

import asyncio

from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.urls import set_script_prefix


class LoopSignalsHandler(ASGIHandler):
    """Django's ASGIHandler, its request signals and response close on the event loop (HTTP only)."""

    async def __call__(self, scope, receive, send):
        # Django's enters a ThreadSensitiveContext here: a new sync thread for every request.
        if scope["type"] != "http":
            raise ValueError(f"this handler serves HTTP only, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        """Django's ASGIHandler.handle, statement for statement, with two changes only: the request
        signals are sent on the event loop (`send`, not `asend`) and a response is closed there
        (`close()`, not `sync_to_async(close)()`), a thread hop each saved. A Django upgrade that
        changes its handle fails tests/core/test_asgi.py until this copy is read again."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            error_response.close()
            return

        async def process_request(request, send):
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:  # the client went away while it was sent
                pass
            return response

        tasks = [asyncio.create_task(self.listen_for_disconnect(receive)),
                 asyncio.create_task(process_request(request, send))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            signals.request_finished.send(sender=self.__class__)
        else:
            response.close()  # sends request_finished
        body_file.close()
