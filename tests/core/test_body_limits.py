"""Every listener bounds request bodies before reading them (core/bodylimit.py), over real HTTP:
the web app under the suite's uvicorn, the serving process's public and internal listeners as
`Listeners` builds them (inference/listeners.py `listener_app`) under uvicorn in a thread.

A 413 that arrives while the client has sent no byte of its body proves the server answered
without reading (or spooling) any of it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.bodylimit import BodyLimit
from inference.listeners import INTERNAL_URLS, PUBLIC_URLS, listener_app
from tests.processes import InThreadServer

EIGHT_GIB = 8 * 1024**3
TOKEN = "internal-test-token"
# The servers read the committed test database (a key looked up, a view's 401).
pytestmark = pytest.mark.django_db(transaction=True)


def _exchange(url: str, head: str, body_chunks: Iterator[bytes] = iter(())) -> tuple[int, bytes]:
    """Sends the request head, then `body_chunks` until the server answers or closes; returns
    the status and the whole answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n")
        sock.settimeout(0.05)
        answer = b""
        for chunk in body_chunks:
            try:
                answer += sock.recv(65536)
            except TimeoutError:
                pass
            if answer:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(30)
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1]), answer


def _head(path: str, *lines: str) -> str:
    return "".join(f"{line}\r\n" for line in (f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *lines))


def _chunked(total: int, size: int = 16 * 1024) -> Iterator[bytes]:
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + b"x" * size + b"\r\n"
    yield b"0\r\n\r\n"


@pytest.fixture(scope="module")
def listeners(django_db_setup, django_db_blocker) -> Iterator[dict[str, str]]:
    servers = {name: InThreadServer(listener_app(urlconf))
               for name, urlconf in (("public", PUBLIC_URLS), ("internal", INTERNAL_URLS))}
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=TOKEN):
        yield {name: server.url for name, server in servers.items()}
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("path", ["/api/v1/events", "/accounts/login/", "/admin/login/", "/nowhere"])
def test_an_unauthenticated_request_declaring_8_gib_is_413_before_a_byte_is_read(asgi_server, path):
    status, answer = _exchange(asgi_server, _head(path, f"Content-Length: {EIGHT_GIB}"))
    assert status == 413 and b"payload_too_large" in answer and b"fix" in answer


def test_a_credentialed_request_declaring_8_gib_is_413_too(asgi_server):
    status, _ = _exchange(asgi_server, _head("/api/v1/events", "Authorization: Bearer fw_made_up",
                                             f"Content-Length: {EIGHT_GIB}"))
    assert status == 413


def test_a_chunked_body_is_cut_at_the_limit(asgi_server):
    head = _head("/api/v1/events", "Transfer-Encoding: chunked", "Content-Type: application/json")
    status, _ = _exchange(asgi_server, head, _chunked(64 * 1024 * 1024))
    assert status == 413


def test_a_request_without_credentials_gets_the_smaller_limit(asgi_server):
    body = b"x" * (100 * 1024)
    anonymous = _head("/api/v1/events", f"Content-Length: {len(body)}")
    assert _exchange(asgi_server, anonymous, iter([body]))[0] == 413
    # The same body with a key is read and reaches the view, which refuses the key.
    keyed = _head("/api/v1/events", f"Content-Length: {len(body)}", "Authorization: Bearer fw_made_up")
    assert _exchange(asgi_server, keyed, iter([body]))[0] == 401


def test_a_malformed_content_length_is_400(asgi_server):
    # uvicorn refuses it before the app (the middleware refuses it too, for other servers).
    assert _exchange(asgi_server, _head("/api/v1/events", "Content-Length: 12, 5"))[0] == 400


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/nowhere"])
def test_the_public_serving_listener_answers_8_gib_with_413_at_once(listeners, path):
    for head in (_head(path, f"Content-Length: {EIGHT_GIB}"),
                 _head(path, f"Content-Length: {EIGHT_GIB}", "Authorization: Bearer fw_made_up")):
        status, answer = _exchange(listeners["public"], head)
        assert status == 413 and b"invalid_request_error" in answer


def test_the_public_serving_listener_cuts_a_chunked_body(listeners):
    head = _head("/v1/completions", "Transfer-Encoding: chunked", "Authorization: Bearer fw_made_up")
    assert _exchange(listeners["public"], head, _chunked(16 * 1024 * 1024))[0] == 413


@pytest.mark.parametrize("path", ["/internal/push", "/internal/load"])
def test_the_internal_listener_reads_a_large_body_only_with_its_token(listeners, path):
    url = listeners["internal"]
    for auth in ("", "Authorization: Bearer wrong-token"):
        status, _ = _exchange(url, _head(path, f"Content-Length: {EIGHT_GIB}", *([auth] if auth else [])))
        assert status == 413
        body = b"x" * (100 * 1024)
        status, _ = _exchange(url, _head(path, f"Content-Length: {len(body)}", *([auth] if auth else [])), iter([body]))
        assert status == 413
    body = b"x" * (100 * 1024)
    head = _head("/internal/push", f"Content-Length: {len(body)}", f"Authorization: Bearer {TOKEN}")
    assert _exchange(url, head, iter([body]))[0] == 409  # read, then: not a registered replica


def test_the_internal_listener_cuts_a_chunked_push_without_its_token(listeners):
    head = _head("/internal/push", "Transfer-Encoding: chunked", "Authorization: Bearer wrong-token")
    assert _exchange(listeners["internal"], head, _chunked(16 * 1024 * 1024))[0] == 413


def _call(limit: BodyLimit, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int | None, bool]:
    """(the status sent, whether the app saw the whole body) for one request through `limit`."""
    import asyncio

    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    seen = {"whole": False}

    async def app(scope, receive, send):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not message.get("more_body"):
                seen["whole"] = True
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    limit.app = app
    asyncio.run(limit({"type": "http", "headers": headers}, receive, send))
    return (sent[0]["status"] if sent else None), seen["whole"]


@given(declared=st.one_of(st.binary(max_size=30), st.integers(0, 2**70).map(lambda n: str(n).encode())),
       sizes=st.lists(st.integers(0, 300), max_size=8), keyed=st.booleans())
@hsettings(max_examples=200, deadline=None)
def test_no_content_length_or_body_gets_past_the_limit_or_raises(declared, sizes, keyed):
    limit = BodyLimit(None, limit=1000, anonymous_limit=100)  # type: ignore[arg-type]
    headers = [(b"content-length", declared)] + ([(b"authorization", b"Bearer x")] if keyed else [])
    chunks = [b"x" * n for n in sizes] or [b""]
    status, whole = _call(limit, headers, chunks)
    bound = 1000 if keyed else 100
    if whole:
        assert sum(sizes) <= bound and declared.isdigit() and int(declared) <= bound and status == 200
    else:
        assert status in (400, 413, None)
