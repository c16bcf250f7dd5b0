"""Per-project membership: pages, the read API, decisions and live pushes are each project's own;
another project's ids answer 404 (as if they did not exist), never 403 and never its data."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from django.test import Client

from core.notify import project_event
from feedback.models import Trajectory
from feedback.services import feedback_ingest, membership_set
from tests.factories import member, trajectory
from training.models import AuditLog, PolicyVersion, TrainingRun
from webapp import consumers
from webapp.asgi import application

pytestmark = pytest.mark.django_db


@pytest.fixture
def other(other_creds):
    """The other project's rows: a trajectory, a version awaiting approval, a run."""
    project = other_creds.project
    feedback_ingest(project, [trajectory("secret-traj", prompt=[{"role": "user", "content": "OTHER-SECRET"}])])
    v1 = PolicyVersion.objects.create(project=project, number=1, state="production")
    v2 = PolicyVersion.objects.create(project=project, number=2, parent=v1, state="awaiting_approval")
    run = TrainingRun.objects.create(project=project, base_version=v1, candidate=v2, state="succeeded")
    return {"project": project, "trajectory": Trajectory.objects.get(project=project), "v2": v2, "run": run}


def _login(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_pages_of_another_project_are_404_like_a_missing_one(alice, other):
    client = _login(alice)  # an approver of acme, no member of other
    for url in ("/p/other/", "/p/other/runs/", "/p/other/rubrics/", "/p/other/rollouts/", "/p/other/registry/",
                f"/p/other/rollouts/{other['trajectory'].pk}/"):
        response = client.get(url)
        assert response.status_code == 404, url
        assert b"no project &#x27;other&#x27; you are a member of" in response.content
        assert b"OTHER-SECRET" not in response.content
    missing = client.get("/p/nope/")
    assert missing.status_code == 404
    listed = client.get("/").content
    assert b"acme" in listed and b"/p/other/" not in listed


def test_another_projects_ids_under_ones_own_project_are_404(alice, creds, other):
    client = _login(alice)
    replay = client.get(f"/p/acme/rollouts/{other['trajectory'].pk}/")
    assert replay.status_code == 404 and b"OTHER-SECRET" not in replay.content
    assert client.get(f"/p/acme/runs/?run={other['run'].pk}").status_code == 404
    decided = client.post("/p/acme/registry/v2/approve/", {"reason": "not ours"})
    assert decided.status_code == 404
    assert PolicyVersion.objects.get(pk=other["v2"].pk).state == "awaiting_approval"


def test_the_api_answers_404_for_another_projects_data_and_versions(alice, creds, other):
    client = _login(alice)
    assert client.get("/api/v1/versions?project=other").status_code == 404
    assert client.get(f"/api/v1/versions/{other['v2'].pk}?project=acme").status_code == 404
    assert client.get("/api/v1/trajectories?project=other").status_code == 404
    assert client.get("/api/v1/trajectories/secret-traj?project=other").status_code == 404
    assert client.get("/api/v1/export?project=other&format=messages").status_code == 404
    response = client.post(f"/api/v1/versions/{other['v2'].pk}/approve", {"reason": "mine now"},
                           content_type="application/json")
    assert response.status_code == 404 and b"OTHER-SECRET" not in response.content
    assert PolicyVersion.objects.get(pk=other["v2"].pk).state == "awaiting_approval"
    assert not AuditLog.objects.filter(project=other["project"]).exists()
    assert client.get("/api/v1/versions?project=acme").status_code == 200  # one's own project reads


def test_roles_are_per_project(alice, creds, other):
    member(alice, other["project"], "viewer")
    client = _login(alice)
    assert client.get("/p/other/registry/").status_code == 200
    assert b">Approve</button>" not in client.get("/p/other/registry/").content
    refused = client.post(f"/api/v1/versions/{other['v2'].pk}/approve", {"reason": "I approve acme's"},
                          content_type="application/json")
    assert refused.status_code == 403 and "not an approver of this project" in refused.json()["error"]["message"]
    assert client.post("/p/other/registry/v2/approve/", {"reason": "x"}).status_code == 403


def test_a_superuser_without_membership_sees_no_project(django_user_model, creds):
    root = django_user_model.objects.create_superuser("root", "root@localhost", "root-password-1")
    client = _login(root)
    assert client.get("/p/acme/").status_code == 404
    assert client.get("/api/v1/versions?project=acme").status_code == 404
    member(root, creds.project, "admin")
    assert client.get("/p/acme/").status_code == 200


def test_an_inactive_member_sees_nothing(bob, creds):
    client = _login(bob)
    bob.is_active = False
    bob.save()
    assert client.get("/api/v1/versions?project=acme").status_code in (401, 403, 404)


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_live_pushes_only_for_members(bob, creds, other_creds):
    client = await sync_to_async(_login)(bob)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def connect(slug: str):
        communicator = WebsocketCommunicator(application, f"/ws/projects/{slug}/",
                                             headers=[(b"cookie", cookie), (b"origin", b"http://localhost")])
        result = await communicator.connect()
        await communicator.disconnect()
        return result

    assert (await connect("acme"))[0] is True
    assert await connect("other") == (False, 4404)
    assert await connect("nope") == (False, 4404)


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_removed_member_stops_receiving_pushes(bob, creds, monkeypatch):
    monkeypatch.setattr(consumers, "MEMBERSHIP_RECHECK_S", 0.0)  # re-check before every push
    client = await sync_to_async(_login)(bob)
    communicator = WebsocketCommunicator(
        application, "/ws/projects/acme/",
        headers=[(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost")])
    assert (await communicator.connect())[0] is True
    await sync_to_async(project_event)(creds.project.id, {"type": "ingest", "accepted": 1})
    assert (await communicator.receive_json_from(timeout=10))["type"] == "ingest"
    await sync_to_async(membership_set)(creds.project, bob, None)
    await sync_to_async(project_event)(creds.project.id, {"type": "ingest", "accepted": 2})
    assert await communicator.receive_output(timeout=10) == {"type": "websocket.close", "code": 4404}
    await sync_to_async(connections.close_all)()  # the consumer's database thread: let the test DB go


def test_a_key_stops_working_once_its_owner_leaves_the_project(client, creds, alice):
    from feedback.models import Membership
    from feedback.services import api_key_create

    key = api_key_create(creds.project, ["read"], "alice-laptop", owner=alice)
    assert client.get("/api/v1/trajectories", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    Membership.objects.filter(user=alice, project=creds.project).delete()
    response = client.get("/api/v1/trajectories", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 401
    assert "no member of project 'acme'" in response.json()["error"]["message"] and response.json()["error"]["fix"]
    # A project's own key (bound to nobody) is not a membership's, and goes on working.
    assert client.get("/api/v1/trajectories", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}").status_code == 200
