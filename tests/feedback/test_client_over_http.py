"""feedback/client.py against uvicorn serving the real ASGI app on the test database."""

from __future__ import annotations

import httpx
import pytest

from feedback.client import FlywheelClient, FlywheelError
from feedback.models import FeedbackEvent, Trajectory
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_client_sends_signed_batches_that_land(asgi_server, creds):
    client = FlywheelClient(asgi_server, creds.webhook_secret, project=creds.project.slug)
    result = client.send([feedback("fb-1", "t-1"), trajectory("t-1")])
    assert result.accepted == 2 and result.attempts == 1
    assert FeedbackEvent.objects.get().trajectory == Trajectory.objects.get()


def test_a_retry_with_the_same_webhook_id_is_a_duplicate(asgi_server, creds):
    client = FlywheelClient(asgi_server, creds.webhook_secret, project=creds.project.slug)
    first = client.send([feedback("fb-1", "t-1")], webhook_id="msg_fixed")
    again = client.send([feedback("fb-1", "t-1")], webhook_id="msg_fixed")
    assert first.accepted == 1 and again.results[0]["status"] == "duplicate"
    assert FeedbackEvent.objects.count() == 1


def test_the_client_retries_429_then_gives_up_with_the_answer(asgi_server, creds, one_rate_window):
    creds.project.rate_limit_per_minute = 1
    creds.project.save()
    calls = []
    http = httpx.Client(event_hooks={"request": [calls.append]})
    # Waits are capped so the test does not sit out the one-minute window.
    client = FlywheelClient(asgi_server, creds.webhook_secret, project=creds.project.slug, max_retries=2,
                            max_wait_s=0.05, http=http)
    client.send([feedback("fb-1", "t-1")])
    with pytest.raises(FlywheelError) as info:
        client.send([feedback("fb-2", "t-1")])
    assert info.value.status == 429 and "rate" in info.value.body["error"]["message"]
    assert len(calls) == 1 + 3
    assert {c.headers["webhook-id"] for c in calls[1:]} == {calls[1].headers["webhook-id"]}
    assert FeedbackEvent.objects.count() == 1


def test_a_wrong_secret_fails_fast_without_retries(asgi_server, creds):
    calls = []

    def count(request):
        calls.append(request)

    http = httpx.Client(event_hooks={"request": [count]})
    client = FlywheelClient(asgi_server, "whsec_" + "B" * 32, project=creds.project.slug, http=http)
    with pytest.raises(FlywheelError) as info:
        client.send([feedback()])
    assert info.value.status == 401 and len(calls) == 1
