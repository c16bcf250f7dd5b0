"""One request-body limit for every listener, enforced before the body is read.

An ASGI middleware around `receive`: a declared `Content-Length` over the limit is answered 413
at once (the app is never called, not a byte is read or spooled); a chunked body (or one longer
than it declared) is cut when it passes the limit: the client gets the 413 and the app a
disconnect, so Django drops what it had buffered. A request carrying no credentials gets a
smaller limit than one that does (`credentialed` says which): a stranger cannot make a listener
read megabytes before its authentication has even run.

    application = BodyLimit(django_application, limit=5 * 2**20, anonymous_limit=64 * 2**10)

Used by the web app (webapp/asgi.py) and both serving listeners (inference/listeners.py).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

ANONYMOUS_MAX_BODY_BYTES = 64 * 1024
_CREDENTIAL_HEADERS = frozenset({b"authorization", b"webhook-signature"})


def header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


def carries_credentials(scope: Scope) -> bool:
    """A bearer key, a webhook signature or a session cookie: worth the full limit (checked for
    real later; a forged one still stops at the full limit)."""
    if any(key.lower() in _CREDENTIAL_HEADERS for key, _ in scope.get("headers", ())):
        return True
    return any(b"sessionid=" in cookie for cookie in header_values(scope, b"cookie"))


class BodyLimit:
    """`app` with its request bodies bounded (see the module docstring)."""

    def __init__(self, app: App, *, limit: int, anonymous_limit: int = ANONYMOUS_MAX_BODY_BYTES,
                 credentialed: Callable[[Scope], bool] = carries_credentials) -> None:
        self.app, self.limit, self.anonymous_limit, self.credentialed = app, limit, anonymous_limit, credentialed

    def limit_for(self, scope: Scope) -> int:
        return self.limit if self.credentialed(scope) else min(self.limit, self.anonymous_limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = header_values(scope, b"content-length")
        if declared and not all(v.isdigit() and len(v) <= 20 for v in declared):
            await refuse(send, 400, f"the Content-Length header {declared[0][:40]!r} is not a number of bytes",
                         "Send the body's size in bytes as Content-Length (or let the HTTP client set it).")
            return
        if declared and max(int(v) for v in declared) > limit:
            await refuse(send, 413, *_too_large(limit, int(declared[0])))
            return
        guard = _Guard(receive, send, limit)
        await self.app(scope, guard.receive, guard.send)


class _Guard:
    """Counts the body as the app reads it; past the limit, answers 413 and tells the app the
    client went away (Django then stops reading and sends nothing)."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.read = 0
        self.started = self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.limit:
                self.refused = True
                if not self.started:
                    await refuse(self._send, 413, *_too_large(self.limit, None))
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


def _too_large(limit: int, declared: int | None) -> tuple[str, str]:
    size = f"declares {declared} bytes" if declared is not None else f"is over {limit} bytes"
    return (f"the request body {size}; this endpoint reads at most {limit} bytes "
            "(less for a request without credentials)",
            f"Send at most {limit} bytes (split a batch; send the API key or signature with the request).")


async def refuse(send: Send, status: int, message: str, fix: str) -> None:
    """The one error shape (core/errors.py), plus the OpenAI client's `type`; the connection is
    closed after it so that an unread body is never read."""
    code = {400: "bad_request", 401: "unauthorized", 413: "payload_too_large"}.get(status, "error")
    body = json.dumps({"error": {"code": code, "message": message, "fix": fix,
                                 "type": "invalid_request_error"}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
