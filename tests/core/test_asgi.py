"""core.asgi.LoopSignalsHandler runs Django's ASGI request handling with two thread hops taken out.
Its `handle` is Django's, statement for statement, but for those two changes: a Django upgrade that
changes `ASGIHandler.handle` fails here, and the copy must be read again."""

from __future__ import annotations

import ast
import inspect
import textwrap

from django.core.handlers.asgi import ASGIHandler

from core.asgi import LoopSignalsHandler


def _function(fn) -> ast.AsyncFunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.AsyncFunctionDef)
    if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]  # the docstring
    return node


class _OnTheLoop(ast.NodeTransformer):
    """Django's handle with this handler's two changes made: `await signal.asend(...)` is
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


def test_the_handle_is_djangos_with_only_the_signals_and_the_close_on_the_loop():
    django, ours = _function(ASGIHandler.handle), _function(LoopSignalsHandler.handle)
    changed = ast.fix_missing_locations(_OnTheLoop().visit(django))
    assert ast.dump(changed) == ast.dump(ours), (
        "Django's ASGIHandler.handle changed: read it again and carry the change into "
        "core/asgi.py LoopSignalsHandler.handle")


def test_djangos_handle_still_makes_the_two_hops_this_one_saves():
    source = inspect.getsource(ASGIHandler.handle)
    assert "request_started.asend" in source and "request_finished.asend" in source
    assert "sync_to_async(response.close)" in source
