"""The dashboard's WebSocket: authenticated users get a push after a feedback batch lands."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from tests.factories import as_django_headers, feedback, sign
from webapp.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


def _session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def _post_batch(creds) -> int:
    body = json.dumps({"events": [feedback("fb-live", "t-live")]}).encode()
    headers = {**sign(creds.webhook_secret, body), "flywheel-project": creds.project.slug}
    response = Client().generic("POST", "/api/v1/events", body, content_type="application/json",
                                **as_django_headers(headers))
    return response.status_code


@pytest.mark.asyncio
async def test_a_logged_in_user_receives_the_ingest_push(bob, creds):
    cookie = await sync_to_async(_session_cookie)(bob)
    communicator = WebsocketCommunicator(
        application, f"/ws/projects/{creds.project.slug}/",
        headers=[(b"cookie", f"sessionid={cookie}".encode()), (b"origin", b"http://localhost")],
    )
    connected, _ = await communicator.connect()
    assert connected
    assert await sync_to_async(_post_batch)(creds) == 202
    message = await communicator.receive_json_from(timeout=10)
    assert message["type"] == "ingest" and message["accepted"] == 1 and message["feedback"] == 1
    await communicator.disconnect()


@pytest.mark.asyncio
async def test_an_anonymous_connection_is_refused(creds):
    communicator = WebsocketCommunicator(application, f"/ws/projects/{creds.project.slug}/",
                                         headers=[(b"origin", b"http://localhost")])
    connected, code = await communicator.connect()
    assert not connected and code == 4401
