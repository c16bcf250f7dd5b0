"""POST /api/v1/versions/{id}/approve|reject|rollback and GET /api/v1/versions[/{id}]:
admin-scope keys, sessions with CSRF, refusals on record."""

from __future__ import annotations

import pytest
from django.middleware.csrf import _get_new_csrf_string
from django.test import Client

from feedback.services import api_key_create, service_account_get
from tests.factories import member
from training.models import AuditLog, GateReport, PolicyVersion

pytestmark = pytest.mark.django_db


@pytest.fixture
def versions(creds):
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    v2 = PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval")
    GateReport.objects.create(version=v2, baseline=v1, passed=True, policy={"version": 0},
                              checks=[{"name": "reward_improvement", "value": 0.2, "threshold": 0.0,
                                       "interval": [0.1, 0.3], "passed": True, "detail": ""}])
    return v1, v2


@pytest.fixture
def admin_key(creds) -> str:
    """An admin key bound to a service account that is an approver of acme."""
    return api_key_create(creds.project, ["admin"], name="ops",
                          owner=member(service_account_get("ops"), creds.project, "approver"))


def bearer(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def session(user, with_token: bool = True) -> tuple[Client, dict[str, str]]:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    if not with_token:
        return client, {}
    token = _get_new_csrf_string()
    client.cookies["csrftoken"] = token
    return client, {"HTTP_X_CSRFTOKEN": token}


def post(client, version, action: str, reason: str | None = "checked the report", **headers):
    body = {} if reason is None else {"reason": reason}
    return client.post(f"/api/v1/versions/{version.id}/{action}", body, content_type="application/json", **headers)


def test_an_admin_key_approves(client, admin_key, versions):
    v1, v2 = versions
    response = post(client, v2, "approve", **bearer(admin_key))
    assert response.status_code == 200, response.json()
    assert response.json()["state"] == "production"
    assert AuditLog.objects.filter(action="approve", actor="service:ops via api_key:acme:ops").exists()  # its owner


def test_a_key_without_admin_scope_is_refused_on_record(client, creds, versions):
    response = post(client, versions[1], "approve", **bearer(creds.api_key))
    assert response.status_code == 403
    assert response.json()["error"]["fix"]
    assert AuditLog.objects.filter(action="approve_refused", actor="api_key:acme").exists()


def test_a_key_of_another_project_cannot_see_the_version(client, other_creds, versions):
    key = api_key_create(other_creds.project, ["admin"])
    assert post(client, versions[1], "approve", **bearer(key)).status_code == 404
    assert PolicyVersion.objects.get(id=versions[1].id).state == "awaiting_approval"


def test_a_session_with_the_permission_and_csrf_approves(alice, versions):
    client, csrf = session(alice)
    response = post(client, versions[1], "approve", **csrf)
    assert response.status_code == 200
    assert response.json()["state"] == "production"


def test_a_session_without_csrf_is_refused(alice, versions):
    client, _ = session(alice, with_token=False)
    response = post(client, versions[1], "approve")
    assert response.status_code == 403
    assert "CSRF" in response.json()["error"]["message"]
    assert PolicyVersion.objects.get(id=versions[1].id).state == "awaiting_approval"


def test_a_viewer_gets_403_and_an_audit_row(bob, versions):
    client, csrf = session(bob)
    response = post(client, versions[1], "approve", **csrf)
    assert response.status_code == 403
    assert "approver role" in response.json()["error"]["fix"]
    assert AuditLog.objects.filter(action="approve_refused", actor="bob").count() == 1


def test_an_outsider_gets_404_and_nothing_is_recorded(charlie, versions):
    client, csrf = session(charlie)
    response = post(client, versions[1], "approve", **csrf)
    assert response.status_code == 404 and response.json()["error"]["fix"]
    assert not AuditLog.objects.exists()


def test_a_missing_reason_is_a_400_that_says_so(alice, versions):
    client, csrf = session(alice)
    response = post(client, versions[1], "approve", reason=None, **csrf)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "a reason is required"


def test_reject_and_rollback_through_the_api(alice, versions):
    v1, v2 = versions
    client, csrf = session(alice)
    assert post(client, v2, "approve", **csrf).json()["state"] == "production"
    assert post(client, v2, "rollback", **csrf).json()["state"] == "retired"
    assert PolicyVersion.objects.get(id=v1.id).state == "production"
    assert post(client, v2, "reject", **csrf).status_code == 409


def test_versions_are_listed_with_their_gate_report(client, creds, versions, django_assert_max_num_queries):
    for n in range(3, 8):
        PolicyVersion.objects.create(project=creds.project, number=n, state="rejected")
    with django_assert_max_num_queries(5):
        response = client.get("/api/v1/versions", **bearer(creds.api_key))
    assert response.status_code == 200
    results = response.json()["results"]
    assert [v["number"] for v in results] == [7, 6, 5, 4, 3, 2, 1]
    v2 = next(v for v in results if v["number"] == 2)
    assert v2["gate_report"]["checks"][0]["interval"] == [0.1, 0.3]
    assert v2["parent"] == 1


def test_one_version_and_a_state_filter(client, creds, versions, alice):
    response = client.get(f"/api/v1/versions/{versions[1].id}", **bearer(creds.api_key))
    assert response.json()["gate_report"]["passed"] is True
    client.force_login(alice)
    listed = client.get("/api/v1/versions?project=acme&state=production").json()["results"]
    assert [v["number"] for v in listed] == [1]
    assert client.get("/api/v1/versions").status_code == 400  # a session must name the project
