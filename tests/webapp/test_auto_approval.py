"""simulate_users --approve: a service account approves what passed the gate, through the
versions API and the same audited service as a person; nothing else is approved."""

from __future__ import annotations

import threading
import time

import pytest

from feedback.services import api_key_create
from training.models import AuditLog, GateReport, PolicyVersion
from webapp.demo.simulator import auto_approve

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_service_account_approves_what_passed_the_gate_and_only_that(asgi_server, creds):
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    passed = PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval")
    GateReport.objects.create(version=passed, baseline=v1, passed=True, policy={}, checks=[])
    failed = PolicyVersion.objects.create(project=creds.project, number=3, parent=v1, state="rejected")
    key = api_key_create(creds.project, ["admin", "read"], name="auto-approver")
    stop = threading.Event()
    worker = threading.Thread(target=auto_approve, args=(asgi_server, key, stop, 0.2), daemon=True)
    worker.start()
    for _ in range(100):
        passed.refresh_from_db()
        if passed.state == "production":
            break
        time.sleep(0.2)
    stop.set()
    worker.join(10)
    failed.refresh_from_db()
    assert (passed.state, failed.state) == ("production", "rejected")
    row = AuditLog.objects.get(action="approve")
    assert row.actor == "api_key:acme:auto-approver" and "passed the evaluation gate" in row.reason
