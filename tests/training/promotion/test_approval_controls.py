"""Approvals that cannot be bypassed: the admin never writes a version's state or the audit log,
the starter of every run is recorded, the two-person rule holds for people, service accounts and
their keys, and refused attempts are rate-limited."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client

from core.errors import Forbidden
from feedback.models import ApiKey
from feedback.services import api_key_create, service_account_get
from tests.factories import member
from training.models import AuditLog, GateReport, PolicyVersion, TrainingRun
from training.promotion.selectors import gate_policy_active
from training.promotion.services import gate_policy_update, membership_grant
from training.runs.services import training_run_start

pytestmark = pytest.mark.django_db


@pytest.fixture
def v1(creds):
    return PolicyVersion.objects.create(project=creds.project, number=1, state="production")


@pytest.fixture
def v2(creds, v1):
    version = PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval")
    GateReport.objects.create(version=version, baseline=v1, passed=True, policy={}, checks=[])
    return version


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@localhost", "root-password-1")


def _admin(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- the admin shows versions and the audit log, and writes neither --------------------------------


def test_the_admin_cannot_change_add_or_delete_a_version(root, v1, v2):
    client = _admin(root)
    form = client.get(f"/admin/training/policyversion/{v2.pk}/change/")
    assert form.status_code == 200 and b'name="state"' not in form.content  # shown, not editable
    edit = {"project": v2.project_id, "number": 2, "state": "production", "manifest_hash": "", "checkpoint_path": "",
            "config": "{}"}
    assert client.post(f"/admin/training/policyversion/{v2.pk}/change/", edit).status_code == 403
    assert client.post("/admin/training/policyversion/add/", {**edit, "number": 3}).status_code == 403
    assert client.post(f"/admin/training/policyversion/{v1.pk}/delete/", {"post": "yes"}).status_code == 403
    bulk = client.post("/admin/training/policyversion/", {"action": "delete_selected", "_selected_action": [v1.pk],
                                                          "post": "yes"})
    assert bulk.status_code in (200, 302)  # no such action: the list is shown again
    assert {v.number: v.state for v in PolicyVersion.objects.all()} == {1: "production", 2: "awaiting_approval"}
    assert not AuditLog.objects.exists()


def test_the_admin_cannot_add_edit_or_delete_audit_rows(root, creds, v2):
    membership_grant(creds.project, root, "viewer", root, "to have a row")
    row = AuditLog.objects.get()
    client = _admin(root)
    forged = {"project": creds.project.pk, "actor": "alice", "action": "approve", "target": f"policy_version:{v2.pk}",
              "before": "{}", "after": "{}", "reason": "forged"}
    assert client.post("/admin/training/auditlog/add/", forged).status_code == 403
    assert client.post(f"/admin/training/auditlog/{row.pk}/change/", forged).status_code == 403
    assert client.post(f"/admin/training/auditlog/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert list(AuditLog.objects.values_list("action", "reason")) == [("membership_grant", "to have a row")]


def test_the_admin_cannot_rewrite_who_started_a_run(root, creds, v1, v2, alice):
    run = TrainingRun.objects.create(project=creds.project, base_version=v1, candidate=v2, started_by=alice)
    client = _admin(root)
    response = client.post(f"/admin/training/trainingrun/{run.pk}/change/",
                           {"project": creds.project.pk, "base_version": v1.pk, "candidate": v2.pk, "state": "succeeded",
                            "config": "{}", "started_by": root.pk, "progress": 1})
    assert response.status_code == 403
    run.refresh_from_db()
    assert run.started_by == alice


# --- the starter of a run is recorded ------------------------------------------------------------------


def test_a_run_records_who_started_it_and_the_scheduler_starts_the_rest(creds, v1, alice):
    mine, _ = training_run_start(creds.project, enqueue=False, started_by=alice)
    assert mine.started_by == alice
    TrainingRun.objects.filter(pk=mine.pk).update(state="succeeded")
    theirs, _ = training_run_start(creds.project, enqueue=False)
    assert theirs.started_by.username == "service:scheduler"
    assert not theirs.started_by.has_usable_password()  # a service account cannot sign in


# --- the two-person rule, end to end through the API --------------------------------------------------


def _approve(version, headers=None, client=None):
    return (client or Client()).post(f"/api/v1/versions/{version.id}/approve", {"reason": "passed the gate"},
                                     content_type="application/json", **(headers or {}))


def _bearer(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.fixture
def two_person(creds, alice, v1, v2):
    gate_policy_update(creds.project, alice, "two people sign off", two_person_rule=True)
    return v2


def _trained_by(starter, creds, version) -> TrainingRun:
    run, _ = training_run_start(creds.project, enqueue=False, started_by=starter)
    TrainingRun.objects.filter(pk=run.pk).update(state="succeeded", candidate=version)
    return run


def test_the_starter_cannot_approve_in_person_or_through_their_key(creds, alice, two_person, django_user_model):
    run = _trained_by(alice, creds, two_person)
    session = Client()
    session.force_login(alice)
    response = _approve(two_person, client=session)
    assert response.status_code == 403
    assert f"alice started run {run.pk}" in response.json()["error"]["message"]
    assert "another approver" in response.json()["error"]["fix"]
    key = api_key_create(creds.project, ["admin", "read"], "alice-laptop", owner=alice)
    response = _approve(two_person, _bearer(key))
    assert response.status_code == 403 and "through a key bound to them" in response.json()["error"]["message"]
    assert PolicyVersion.objects.get(pk=two_person.pk).state == "awaiting_approval"
    assert list(AuditLog.objects.filter(action="approve_refused").values_list("actor", flat=True)) == [
        "alice", "alice via api_key:acme:alice-laptop"]
    dave = member(django_user_model.objects.create_user("dave"), creds.project, "approver")
    response = _approve(two_person, _bearer(api_key_create(creds.project, ["admin"], "dave", owner=dave)))
    assert response.status_code == 200 and response.json()["state"] == "production"


def test_the_scheduler_starts_and_another_service_account_approves(creds, two_person):
    _trained_by(None, creds, two_person)  # the beat's runs: service:scheduler
    scheduler = service_account_get("scheduler")
    member(scheduler, creds.project, "approver")
    own = _approve(two_person, _bearer(api_key_create(creds.project, ["admin"], "sched", owner=scheduler)))
    assert own.status_code == 403 and "service:scheduler" in own.json()["error"]["message"]
    approver = member(service_account_get("auto-approver"), creds.project, "approver")
    response = _approve(two_person, _bearer(api_key_create(creds.project, ["admin"], "auto", owner=approver)))
    assert response.status_code == 200, response.json()
    assert AuditLog.objects.get(action="approve").actor == "service:auto-approver via api_key:acme:auto"


def test_a_version_without_a_recorded_starter_is_refused_under_the_rule(creds, alice, two_person):
    session = Client()
    session.force_login(alice)
    response = _approve(two_person, client=session)
    assert response.status_code == 403 and "no recorded starter" in response.json()["error"]["message"]


def test_a_key_bound_to_nobody_decides_nothing(creds, v2):
    response = _approve(v2, _bearer(api_key_create(creds.project, ["admin"], "orphan")))
    assert response.status_code == 403
    assert "bound to no person or service account" in response.json()["error"]["message"]
    assert "--owner" in response.json()["error"]["fix"]


def test_a_key_acts_only_within_its_owners_role(creds, bob, v2):
    response = _approve(v2, _bearer(api_key_create(creds.project, ["admin"], "bob", owner=bob)))  # bob views
    assert response.status_code == 403 and "not an approver" in response.json()["error"]["message"]
    assert PolicyVersion.objects.get(pk=v2.pk).state == "awaiting_approval"


def test_a_deactivated_owners_key_is_refused(creds, alice, v2):
    key = api_key_create(creds.project, ["admin"], "alice", owner=alice)
    alice.is_active = False
    alice.save()
    response = _approve(v2, _bearer(key))
    assert response.status_code == 401 and "deactivated" in response.json()["error"]["message"]


# --- refusals are rate-limited -------------------------------------------------------------------------


def test_refused_attempts_are_rate_limited_with_retry_after(creds, bob, v2, settings):
    settings.FLYWHEEL_REFUSALS_MAX = 3
    settings.FLYWHEEL_REFUSAL_WINDOW_S = 10**9  # one window for the whole test
    session = Client()
    session.force_login(bob)
    codes = [_approve(v2, client=session).status_code for _ in range(3)]
    over = _approve(v2, client=session)
    assert codes == [403, 403, 403] and over.status_code == 429
    assert 0 < int(over["Retry-After"]) <= 10**9
    assert "too many refused decisions from bob" in over.json()["error"]["message"]
    assert over.json()["error"]["fix"].startswith("Retry after")
    key = _bearer(api_key_create(creds.project, ["admin"], "orphan"))
    assert [_approve(v2, key).status_code for _ in range(5)] == [403, 403, 403, 429, 429]  # counted per principal
    assert AuditLog.objects.filter(action="approve_refused").count() == 6


# --- memberships are granted through an audited service ---------------------------------------------


def test_granting_a_role_is_audited_and_only_admins_or_superusers_may(creds, alice, charlie, root):
    with pytest.raises(Forbidden, match="may not change the members"):
        membership_grant(creds.project, charlie, "approver", alice, "alice is only an approver")
    membership_grant(creds.project, charlie, "approver", root, "on call this week")
    membership_grant(creds.project, charlie, None, root, "rotation over")
    rows = list(AuditLog.objects.values_list("actor", "action", "target", "before", "after"))
    assert rows == [("root", "membership_grant", "user:charlie", {"role": None}, {"role": "approver"}),
                    ("root", "membership_revoke", "user:charlie", {"role": "approver"}, {"role": None})]


def test_the_command_line_grants_roles_and_binds_keys(creds, charlie):
    out = StringIO()
    call_command("member", "acme", "charlie", "approver", "--reason", "on call", stdout=out)
    assert "charlie in acme: none -> approver" in out.getvalue()
    call_command("member", "acme", "service:nightly", "viewer", stdout=StringIO())
    assert list(AuditLog.objects.values_list("actor", "target", "after")) == [
        ("system:cli", "user:charlie", {"role": "approver"}), ("system:cli", "user:service:nightly", {"role": "viewer"})]
    raw = StringIO()
    call_command("create_key", "acme", "--scopes", "admin", "--service-account", "nightly", stdout=raw)
    key = ApiKey.objects.get(key_hash=ApiKey.hash_key(raw.getvalue().strip()))
    assert key.owner.username == "service:nightly"


def test_only_a_project_admin_or_superuser_changes_the_gate_policy_in_the_admin(creds, django_user_model):
    staff = django_user_model.objects.create_user("staffer", password="staffer-password-1", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=["change_gatepolicy", "view_gatepolicy"]))
    member(staff, creds.project, "approver")
    form = {"project": creds.project.pk, "thresholds": "{}", "canary_share": 0, "canary_min_events": 100,
            "canary_max_events": 20000, "canary_confidence": 0.95, "note": "rule off"}  # two_person_rule unticked
    gate_policy_update(creds.project, "system:test", "rule on", two_person_rule=True)
    policy = gate_policy_active(creds.project)
    response = _admin(staff).post(f"/admin/training/gatepolicy/{policy.pk}/change/", form)
    assert response.status_code == 403
    assert gate_policy_active(creds.project).two_person_rule is True
    member(staff, creds.project, "admin")
    assert _admin(staff).post(f"/admin/training/gatepolicy/{policy.pk}/change/", form).status_code == 302
    assert gate_policy_active(creds.project).two_person_rule is False
