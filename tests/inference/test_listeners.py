"""The serving listeners (inference/listeners.py) run Django's ASGI request handling with two thread
hops taken out. Their `handle` is Django's, statement for statement, but for those two changes: a
Django upgrade that changes `ASGIHandler.handle` fails here, and the copy must be read again."""

from __future__ import annotations

import ast
import inspect
import textwrap

import httpx
import pytest
from django.conf import settings
from django.core import signals
from django.core.handlers.asgi import ASGIHandler

from inference.listeners import PUBLIC_URLS, ListenerHandler, listener_app
from tests.processes import InThreadServer


def _function(fn) -> ast.AsyncFunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.AsyncFunctionDef)
    if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]  # the docstring
    return node


class _OnTheLoop(ast.NodeTransformer):
    """Django's handle with the listener's two changes made: `await signal.asend(...)` is
    `signal.send(...)`, and `await sync_to_async(x.close)()` is `x.close()`."""

    def visit_Await(self, node: ast.Await) -> ast.AST:
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "asend":
            call.func.attr = "send"
            return self.generic_visit(call)
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Call) and not call.args
                and isinstance(call.func.func, ast.Name) and call.func.func.id == "sync_to_async"):
            return ast.Call(func=call.func.args[0], args=[], keywords=[])
        return self.generic_visit(node)


def test_the_listeners_handle_is_djangos_with_only_the_signals_and_the_close_on_the_loop():
    django, ours = _function(ASGIHandler.handle), _function(ListenerHandler.handle)
    changed = ast.fix_missing_locations(_OnTheLoop().visit(django))
    assert ast.dump(changed) == ast.dump(ours), (
        "Django's ASGIHandler.handle changed: read it again and carry the change into "
        "inference/listeners.py ListenerHandler.handle")


def test_djangos_handle_still_makes_the_two_hops_the_listener_saves():
    source = inspect.getsource(ASGIHandler.handle)
    assert "request_started.asend" in source and "request_finished.asend" in source
    assert "sync_to_async(response.close)" in source


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
