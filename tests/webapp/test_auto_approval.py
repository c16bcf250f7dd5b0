"""simulate_users --approve: a service account approves what passed the gate, through the
versions API and the same audited service as a person; nothing else is approved."""

from __future__ import annotations

import threading

import pytest
from django.test import Client

import webapp.demo as demo
from feedback.models import Membership, Project
from feedback.services import api_key_create, service_account_get
from tests.factories import member
from tests.processes import wait_until
from training.models import AuditLog, GateReport, PolicyVersion, TrainingRun
from training.promotion.selectors import gate_policy_active
from training.runs.services import training_run_start
from webapp.demo.simulator import auto_approve

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_service_account_approves_what_passed_the_gate_and_only_that(asgi_server, creds):
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    passed = PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval")
    GateReport.objects.create(version=passed, baseline=v1, passed=True, policy={}, checks=[])
    failed = PolicyVersion.objects.create(project=creds.project, number=3, parent=v1, state="rejected")
    approver = member(service_account_get("auto-approver"), creds.project, "approver")
    key = api_key_create(creds.project, ["admin", "read"], name="auto-approver", owner=approver)
    stop = threading.Event()
    worker = threading.Thread(target=auto_approve, args=(asgi_server, key, stop, 0.2), daemon=True)
    worker.start()
    try:
        wait_until(lambda: PolicyVersion.objects.get(pk=passed.pk).state == "production", timeout=20,
                   what="the passed version approved")
    finally:
        stop.set()
        worker.join(10)
    passed.refresh_from_db()
    failed.refresh_from_db()
    assert (passed.state, failed.state) == ("production", "rejected")
    row = AuditLog.objects.get(action="approve")
    assert row.actor == "service:auto-approver via api_key:acme:auto-approver"
    assert "passed the evaluation gate" in row.reason


@pytest.mark.django_db
def test_the_demo_runs_two_people_the_scheduler_starts_and_the_auto_approver_approves(tmp_path, monkeypatch):
    """`make demo AUTO_APPROVE=1`'s accounts: the two-person rule is on, the beat's runs are the
    scheduler's, and the auto-approver's key (bound to another service account) may approve them."""
    monkeypatch.setattr(demo, "DEMO_FILE", tmp_path / "demo.json")
    monkeypatch.setenv("AUTO_APPROVE", "1")
    state = demo._demo_state()
    project = Project.objects.get(slug="demo")
    assert gate_policy_active(project).two_person_rule
    roles = dict(Membership.objects.filter(project=project).values_list("user__username", "role"))
    assert roles == {"admin": "admin", "service:auto-approver": "approver"}
    v1 = PolicyVersion.objects.create(project=project, number=1, state="production")
    v2 = PolicyVersion.objects.create(project=project, number=2, parent=v1, state="awaiting_approval")
    run, _ = training_run_start(project, enqueue=False)  # as the beat starts it
    TrainingRun.objects.filter(pk=run.pk).update(state="succeeded", candidate=v2)
    response = Client().post(f"/api/v1/versions/{v2.id}/approve", {"reason": "auto-approval: passed the gate"},
                             content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {state['approver_key']}")
    assert response.status_code == 200, response.json()
    assert AuditLog.objects.get(action="approve").actor == "service:auto-approver via api_key:demo:auto-approver"
    assert demo._demo_state()["approver_key"] == state["approver_key"]  # idempotent: the key is kept
