"""Each serving replica has a token of its own (inference/tokens.py): the web app sends every
replica its own, and a replica deployed with only its token accepts no other replica's, nor the
shared one, on /internal/push and /internal/load. Over real HTTP (the internal listener as
serve_policy builds it, under uvicorn in a thread)."""

from __future__ import annotations

import httpx
import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from inference import apis
from inference.listeners import INTERNAL_URLS, listener_app
from inference.tokens import replica_token
from tests.processes import InThreadServer
from training.models import ServingReplica
from training.replicas import services

MASTER = "the-shared-internal-token"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def replica(monkeypatch):
    server = InThreadServer(listener_app(INTERNAL_URLS))
    # Deployed with its own token only: the shared one is not configured on this replica.
    monkeypatch.setattr(apis, "REPLICA_TOKEN", replica_token(MASTER, server.url))
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=""):
        yield server.url
    server.stop()


def _push(url: str, token: str) -> httpx.Response:
    return httpx.post(url + "/internal/push", content=b"x", headers={"Authorization": f"Bearer {token}"})


def test_a_replica_accepts_its_own_token_and_no_other_replicas_nor_the_shared_one(replica):
    assert _push(replica, replica_token(MASTER, replica)).status_code == 409  # through: not registered here
    for token in (replica_token(MASTER, "http://10.0.0.2:8002"), MASTER, "x"):
        refused = _push(replica, token)
        assert refused.status_code == 401 and refused.json()["error"]["fix"]
    load = httpx.post(replica + "/internal/load", json={"canary": None},
                      headers={"Authorization": f"Bearer {replica_token(MASTER, 'http://10.0.0.2:8002')}"})
    assert load.status_code == 401


def test_the_broadcast_sends_each_replica_its_own_token(replica, creds):
    now = timezone.now()
    row = ServingReplica.objects.create(project=creds.project, address=replica, version=1,
                                        registered_at=now, heartbeat_at=now)
    outcome = services._send(row, [b"x"], MASTER, timeout=10)
    assert outcome.error.startswith("409"), outcome.error  # authenticated, then: not a registered replica
    row.address = replica + "/"  # registered under another address: that address's token, refused here
    assert services._send(row, [b"x"], MASTER, timeout=10).error.startswith("401")


def test_the_replica_token_command_prints_the_token_of_an_address(capsys, settings):
    settings.FLYWHEEL_INTERNAL_TOKEN = MASTER
    call_command("replica_token", "http://replica-2:8002")
    assert capsys.readouterr().out.strip() == replica_token(MASTER, "http://replica-2:8002")
