"""The admin cannot escalate: staff rights are not project rights, credentials cannot be widened
or revived from a form, every change is audited, and a new webhook secret never sits in a cookie.

Everyone here is staff with every model permission, as a careless deployment would make them:
only the Membership decides. alice is an approver of acme, bob a viewer, charlie (made here) its
admin, or the admin of another project.

    .venv/bin/python -m pytest tests/training/test_project_admin.py -q
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from feedback.models import ApiKey, FeedbackEvent, Membership, Quarantine, Trajectory, WebhookSecret
from feedback.services import (
    api_key_create,
    feedback_ingest,
    project_create,
    quarantine_record,
    webhook_secret_create,
)
from tests.factories import feedback, trajectory
from training.models import AuditLog, EvalSuite, RewardSpec
from training.rewards.services import reward_spec_default

pytestmark = pytest.mark.django_db


def staff(user):
    user.is_staff = True
    user.save()
    user.user_permissions.add(*Permission.objects.all())
    return user


@pytest.fixture
def acme_admin(charlie, creds):
    Membership.objects.create(project=creds.project, user=charlie, role="admin")
    return staff(charlie)


@pytest.fixture
def other_admin(charlie):
    other = project_create("Other Product", "other")
    Membership.objects.create(project=other.project, user=charlie, role="admin")
    return staff(charlie)


def _spec_form(spec: RewardSpec, settle: int) -> dict:
    return {"project": spec.project_id, "signal_rewards": json.dumps(spec.signal_rewards),
            "checks": json.dumps(spec.checks), "aspects": json.dumps(spec.aspects), "judge": json.dumps(spec.judge),
            "settle_seconds": settle}


def _edits(creds):
    """(url, form) for one edit of each project row a staff account might reach."""
    spec = reward_spec_default(creds.project)
    suite = EvalSuite.objects.create(project=creds.project, version=1, prompts=[{"id": "p", "prompt": "x"}],
                                     checks=[], aspects=[], n_samples=1, max_tokens=8)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    traj, event = Trajectory.objects.get(), FeedbackEvent.objects.get()
    return {
        "reward spec": (f"/admin/training/rewardspec/{spec.pk}/change/", _spec_form(spec, 99)),
        "eval suite": (f"/admin/training/evalsuite/{suite.pk}/change/", {
            "project": creds.project.pk, "name": "default", "prompts": json.dumps([{"id": "p", "prompt": "EDITED"}]),
            "checks": "[]", "aspects": "[]", "judge": "null", "n_samples": 1, "max_tokens": 8, "temperature": 1.0,
            "seed": 0}),
        "trajectory": (f"/admin/feedback/trajectory/{traj.pk}/change/", {
            "project": creds.project.pk, "external_id": "t-1", "source": traj.source, "task": "EDITED",
            "tags": "[]", "extra": "{}", "prompt": json.dumps(traj.prompt), **_when(traj.occurred_at),
            **_empty_inlines()}),
        "feedback": (f"/admin/feedback/feedbackevent/{event.pk}/change/", {
            "project": creds.project.pk, "event_id": "fb-1", "signal": "reject", "value": "",
            "trajectory_external_id": "t-1", **_when(event.occurred_at)}),
    }


def _when(at) -> dict:
    at = timezone.localtime(at)
    return {"occurred_at_0": at.strftime("%Y-%m-%d"), "occurred_at_1": at.strftime("%H:%M:%S")}


def _empty_inlines() -> dict:
    return {f"{p}-{k}": v for p in ("steps", "feedback_events")
            for k, v in (("TOTAL_FORMS", 0), ("INITIAL_FORMS", 0), ("MIN_NUM_FORMS", 0), ("MAX_NUM_FORMS", 1000))}


def _state(creds) -> tuple:
    return (RewardSpec.objects.get(version=1).settle_seconds, EvalSuite.objects.count(),
            Trajectory.objects.get().task, FeedbackEvent.objects.get().signal)


@pytest.mark.parametrize("who", ["alice", "bob", "other_admin"])
@pytest.mark.parametrize("row", ["reward spec", "eval suite", "trajectory", "feedback"])
def test_staff_who_are_not_admins_of_the_project_cannot_change_its_rows(client, creds, request, who, row):
    user = request.getfixturevalue(who)
    client.force_login(staff(user) if who != "other_admin" else user)
    url, form = _edits(creds)[row]
    before = _state(creds)
    response = client.post(url, form)
    assert response.status_code == 403
    assert _state(creds) == before and not AuditLog.objects.filter(action__startswith="admin_").exists()


@pytest.mark.parametrize(("row", "changed"), [("reward spec", 0), ("eval suite", 1), ("trajectory", 2),
                                              ("feedback", 3)])
def test_an_admin_of_the_project_changes_its_rows_and_each_change_is_audited(client, creds, acme_admin, row,
                                                                             changed):
    client.force_login(acme_admin)
    url, form = _edits(creds)[row]
    before = _state(creds)
    response = client.post(url, form)
    assert response.status_code == 302, _errors(response)
    after = _state(creds)
    assert after[changed] != before[changed]
    entry = AuditLog.objects.get(action="admin_change")
    assert entry.actor == "charlie" and entry.project_id == creds.project.pk and entry.reason == "admin"
    assert entry.before != entry.after


def test_an_admin_cannot_add_a_row_to_a_project_it_does_not_administer(client, creds, other_admin):
    client.force_login(other_admin)
    spec = reward_spec_default(creds.project)
    response = client.post("/admin/training/rewardspec/add/", {**_spec_form(spec, 5), "version": 2})
    assert response.status_code == 200 and b"Select a valid choice" in response.content
    assert RewardSpec.objects.filter(project=creds.project).count() == 1


def _plain_key(creds, revoked: bool = False) -> ApiKey:
    key = ApiKey.objects.get(prefix=api_key_create(creds.project, ["read"], name="ci")[:11])
    if revoked:
        key.revoked_at = timezone.now() - timedelta(days=1)
        key.save()
    return key


def test_a_keys_scopes_cannot_be_widened_nor_its_revocation_undone(client, creds, acme_admin):
    client.force_login(acme_admin)
    key = _plain_key(creds)
    form = {"name": "ci", "scopes": json.dumps(list(ApiKey.SCOPES)), "revoked_at_0": "", "revoked_at_1": ""}
    assert client.post(f"/admin/feedback/apikey/{key.pk}/change/", form).status_code == 302
    key.refresh_from_db()
    assert key.scopes == ["read"] and key.revoked_at is None
    revoked = _plain_key(creds, revoked=True)
    revoked_at = revoked.revoked_at
    client.post(f"/admin/feedback/apikey/{revoked.pk}/change/", {**form, "name": "revived"})
    revoked.refresh_from_db()
    assert revoked.revoked_at == revoked_at and revoked.scopes == ["read"]
    assert client.get("/admin/feedback/apikey/add/").status_code == 403  # keys come from create_key


def test_revoking_a_key_in_the_admin_is_audited(client, creds, acme_admin):
    client.force_login(acme_admin)
    key = _plain_key(creds)
    now = timezone.localtime()
    form = {"name": "ci", "revoked_at_0": now.strftime("%Y-%m-%d"), "revoked_at_1": now.strftime("%H:%M:%S")}
    assert client.post(f"/admin/feedback/apikey/{key.pk}/change/", form).status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None
    entry = AuditLog.objects.get(action="admin_change", target=f"apikey:{key.pk}")
    assert entry.before["revoked_at"] is None and entry.after["revoked_at"] is not None
    assert "key_hash" not in entry.after


def test_a_revoked_or_expired_webhook_secret_cannot_be_revived(client, creds, acme_admin):
    client.force_login(acme_admin)
    ended = timezone.now() - timedelta(hours=1)
    secret = webhook_secret_create(creds.project)
    WebhookSecret.objects.filter(pk=secret.pk).update(revoked_at=ended, expires_at=ended)
    empty = {"expires_at_0": "", "expires_at_1": "", "revoked_at_0": "", "revoked_at_1": ""}
    client.post(f"/admin/feedback/webhooksecret/{secret.pk}/change/", empty)
    secret.refresh_from_db()
    assert secret.revoked_at == ended and secret.expires_at == ended


def test_a_new_webhook_secret_is_shown_once_on_a_page_and_never_in_a_cookie(client, creds, acme_admin):
    client.force_login(acme_admin)
    response = client.post("/admin/feedback/webhooksecret/add/", {"project": creds.project.pk})
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    row = WebhookSecret.objects.filter(project=creds.project).latest("pk")
    assert row.secret in response.content.decode()
    assert all(row.secret not in morsel.value for morsel in response.cookies.values())
    assert row.secret not in str(client.cookies)
    listing = client.get("/admin/feedback/webhooksecret/").content.decode()
    assert row.secret not in listing and row.secret[6:16] not in listing
    assert AuditLog.objects.get(action="admin_add", target=f"webhooksecret:{row.pk}").after["project_id"] == \
        creds.project.pk


def _errors(response) -> str:
    import re

    html = response.content.decode()
    return " | ".join(re.sub(r"<[^>]+>", " ", m)[:300] for m in re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>',
                                                                         html, re.S))


def test_a_projects_settings_change_only_by_its_admins_and_are_audited(client, creds, alice, charlie):
    form = {"slug": "acme", "name": "Acme Autocomplete", "rate_limit_per_minute": 10**9}
    client.force_login(staff(alice))
    assert client.post(f"/admin/feedback/project/{creds.project.pk}/change/", form).status_code == 403
    creds.project.refresh_from_db()
    assert creds.project.rate_limit_per_minute != 10**9
    Membership.objects.create(project=creds.project, user=charlie, role="admin")
    client.force_login(staff(charlie))
    assert client.post(f"/admin/feedback/project/{creds.project.pk}/change/", form).status_code == 302, \
        _errors(client.post(f"/admin/feedback/project/{creds.project.pk}/change/", form))
    creds.project.refresh_from_db()
    assert creds.project.rate_limit_per_minute == 10**9
    entry = AuditLog.objects.get(action="admin_change", target=f"project:{creds.project.pk}")
    assert entry.after["rate_limit_per_minute"] == 10**9
    assert client.get("/admin/feedback/project/add/").status_code == 403  # a superuser's


def test_a_quarantined_item_is_released_only_by_an_admin_of_its_project_on_record(client, creds, alice, charlie):
    quarantine_record(creds.project.pk, "reward", "trajectory t-9", "boom")
    row = Quarantine.objects.get()
    client.force_login(staff(alice))
    assert client.post(f"/admin/feedback/quarantine/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Quarantine.objects.filter(pk=row.pk).exists()
    Membership.objects.create(project=creds.project, user=charlie, role="admin")
    client.force_login(staff(charlie))
    assert client.post(f"/admin/feedback/quarantine/{row.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not Quarantine.objects.filter(pk=row.pk).exists()
    assert AuditLog.objects.get(action="admin_delete", target=f"quarantine:{row.pk}").before["item"] == "trajectory t-9"
