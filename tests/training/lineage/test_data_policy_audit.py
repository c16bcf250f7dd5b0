"""Every change of a project's data policy and opt-out list is on the audit log: through the API
and the command line, one row a change, with the fields it changed before and after; an opt-out's
row names the user by a peppered reference, never by their id or the hash their rows carry.

    .venv/bin/python -m pytest tests/training/lineage/test_data_policy_audit.py -q
"""

from __future__ import annotations

import json

import pytest
from django.contrib import admin
from django.core.management import CommandError, call_command

from feedback.models import DEFAULT_REDACTORS, ConsentOptOut, DataPolicy
from feedback.services import api_key_create, user_audit_ref, user_hash_of
from tests.factories import member
from training.lineage.services import consent_opt_out_update, data_policy_update
from training.models import AuditLog

CHANGES = [
    ({"consent_default": "no_train"}, {"consent_default": "train"}),
    ({"retention_days": 30}, {"retention_days": None}),
    ({"erasure_policy": "retrain"}, {"erasure_policy": "flag"}),
    ({"redactors": ["email"]}, {"redactors": list(DEFAULT_REDACTORS)}),
    ({"custom_patterns": [{"name": "ticket", "pattern": "ACME-[0-9]{6,10}"}]}, {"custom_patterns": []}),
]


@pytest.fixture
def admin_headers(creds, alice) -> dict[str, str]:
    key = api_key_create(creds.project, ["admin"], name="privacy", owner=member(alice, creds.project, "admin"))
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.mark.parametrize(("change", "before"), CHANGES, ids=[next(iter(c)) for c, _ in CHANGES])
def test_each_data_policy_change_through_the_api_leaves_one_audit_row_with_its_fields_before_and_after(
        creds, client, admin_headers, change, before):
    answer = client.patch("/api/v1/data-policy", {**change, "reason": "ticket 12"},
                          content_type="application/json", **admin_headers)
    assert answer.status_code == 200, answer.content
    row = AuditLog.objects.get()
    assert (row.action, row.target, row.actor) == ("data_policy_update", "data_policy:acme",
                                                   "alice via api_key:acme:privacy")
    assert (row.before, row.after, row.reason) == (before, change, "ticket 12")
    again = client.patch("/api/v1/data-policy", change, content_type="application/json", **admin_headers)
    assert again.status_code == 200 and AuditLog.objects.count() == 1  # nothing changed: nothing to record


def test_a_change_of_several_fields_is_one_row_and_a_refused_change_is_none(creds, client, admin_headers):
    bad = client.patch("/api/v1/data-policy", {"retention_days": 7, "redactors": ["email", "phone"]},
                       content_type="application/json", **admin_headers)
    assert bad.status_code == 400 and "Use any of" in bad.json()["error"]["fix"]
    assert not AuditLog.objects.exists() and not DataPolicy.objects.exists()
    ok = client.patch("/api/v1/data-policy", {"retention_days": 7, "erasure_policy": "keep",
                                              "consent_default": "train"}, content_type="application/json",
                      **admin_headers)
    assert ok.status_code == 200
    row = AuditLog.objects.get()
    assert row.before == {"erasure_policy": "flag", "retention_days": None}  # consent_default did not change
    assert row.after == {"erasure_policy": "keep", "retention_days": 7} and row.reason == ""


def test_an_opt_out_and_an_opt_in_are_one_row_each_naming_neither_the_user_nor_their_hash(
        creds, client, admin_headers):
    user = "ursula@example.com"  # "ursula" has letters no hex digest holds, so a hash cannot match it
    body = {"user": user, "opted_out": True}
    for _ in range(2):  # the second changes nothing
        assert client.post("/api/v1/consent/opt-outs", body, content_type="application/json",
                           **admin_headers).status_code == 200
    assert client.post("/api/v1/consent/opt-outs", {"user": user, "opted_out": False},
                       content_type="application/json", **admin_headers).json() == {
        "opted_out": False, "was_opted_out": True}
    rows = list(AuditLog.objects.order_by("seq"))
    assert [(r.action, r.before, r.after) for r in rows] == [
        ("consent_opt_out", {"opted_out": False}, {"opted_out": True}),
        ("consent_opt_in", {"opted_out": True}, {"opted_out": False})]
    ref = user_audit_ref(creds.project, user)
    assert {r.target for r in rows} == {f"user_ref:{ref}"}
    stored = json.dumps([[r.actor, r.target, r.before, r.after, r.reason] for r in rows])
    assert user not in stored and "ursula" not in stored and user_hash_of(creds.project, user) not in stored


def test_the_command_line_changes_the_policy_and_the_opt_out_list_audited(creds, capsys):
    call_command("data_policy", project="acme", retention_days="90", redactors="email,ipv4", reason="DPA")
    shown = json.loads(capsys.readouterr().out)
    assert (shown["retention_days"], shown["redactors"]) == (90, ["email", "ipv4"])
    call_command("data_policy", project="acme", retention_days="none")
    call_command("data_policy", project="acme", opt_out="u-9")
    rows = list(AuditLog.objects.order_by("seq"))
    assert [(r.actor, r.action, r.after) for r in rows] == [
        ("cli:data_policy", "data_policy_update", {"redactors": ["email", "ipv4"], "retention_days": 90}),
        ("cli:data_policy", "data_policy_update", {"retention_days": None}),
        ("cli:data_policy", "consent_opt_out", {"opted_out": True})]
    assert rows[0].reason == "DPA" and ConsentOptOut.objects.get().user_hash == user_hash_of(creds.project, "u-9")
    with pytest.raises(CommandError, match="whole number of days"):
        call_command("data_policy", project="acme", retention_days="ninety")
    with pytest.raises(CommandError, match="Give a whole number of days from 1 to 36500"):
        call_command("data_policy", project="acme", retention_days="0")
    assert AuditLog.objects.count() == 3


def test_the_services_audit_what_the_admin_could_otherwise_change_unrecorded(creds, alice):
    # No admin page writes the policy or the list around the services (they are not registered).
    assert DataPolicy not in admin.site._registry and ConsentOptOut not in admin.site._registry
    data_policy_update(creds.project, alice, "quarterly review", consent_default="no_train")
    assert consent_opt_out_update(creds.project, "u-1", True, alice) is False
    assert [(r.actor, r.action) for r in AuditLog.objects.order_by("seq")] == [
        ("alice", "data_policy_update"), ("alice", "consent_opt_out")]
