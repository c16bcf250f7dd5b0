"""Approval, the two-person rule, rollback, the append-only audit log, production_at and canaries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, transaction
from django.utils import timezone

from core.errors import BadRequest, Conflict, Forbidden, NotFound
from feedback.services import feedback_ingest
from tests.factories import feedback, member, trajectory
from training.models import AuditLog, CanaryRun, PolicyVersion, TrainingRun
from training.promotion.services import canary_decide, candidate_promote, gate_policy_update
from training.promotion.tasks import gate_canaries_check_task
from training.versions.selectors import audit_for_version, production_at, serving_target, version_lineage

pytestmark = pytest.mark.django_db


@pytest.fixture
def v1(creds):
    return PolicyVersion.objects.create(project=creds.project, number=1, state="production", checkpoint_path="/ck/1")


@pytest.fixture
def v2(creds, v1):
    return PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval",
                                        checkpoint_path="/ck/2")


def state(version) -> str:
    version.refresh_from_db()
    return version.state


def test_the_owner_approves_and_the_version_serves(alice, v1, v2):
    candidate_promote(v2, alice, "approve", "better on the suite")
    assert (state(v2), state(v1)) == ("production", "retired")
    assert serving_target(v2.project_id).production == 2
    row = audit_for_version(v2).last()
    assert (row.actor, row.action, row.before["state"], row.after["state"], row.reason) == (
        "alice", "approve", "awaiting_approval", "production", "better on the suite")
    assert audit_for_version(v1).last().action == "retire"


def test_a_version_moves_only_along_its_transitions_and_a_refused_move_records_nothing(creds, v1):
    from training.versions.services import version_transition

    v3 = PolicyVersion.objects.create(project=creds.project, number=3, parent=v1, state="candidate")
    with pytest.raises(Conflict, match="policy v3 is candidate; it cannot become canary") as exc:
        version_transition(v3, "canary", "test", "canary_start")  # a canary comes from an approval
    assert exc.value.fix == "From candidate it can become: gated, production, rejected."
    assert state(v3) == "candidate" and not audit_for_version(v3).exists()
    with pytest.raises(Conflict, match="policy v4 is rejected; it cannot become production") as exc:
        version_transition(PolicyVersion.objects.create(project=creds.project, number=4, state="rejected"),
                           "production", "test", "rollback")
    assert exc.value.fix == "From rejected it can become: nothing."
    for step in ("gated", "awaiting_approval", "canary", "production"):
        version_transition(v3, step, "test", step)
    assert [r.after["state"] for r in audit_for_version(v3)] == ["gated", "awaiting_approval", "canary", "production"]


def test_a_viewer_is_refused_and_the_refusal_is_recorded(bob, v2):
    with pytest.raises(Forbidden, match="may not approve"):
        candidate_promote(v2, bob, "approve", "looks fine to me")
    assert state(v2) == "awaiting_approval"
    row = AuditLog.objects.get(action="approve_refused")
    assert (row.actor, row.reason) == ("bob", "looks fine to me")


def test_an_outsider_does_not_see_the_version_and_nothing_is_recorded(charlie, v2):
    with pytest.raises(NotFound):
        candidate_promote(v2, charlie, "approve", "looks fine to me")
    assert state(v2) == "awaiting_approval" and not AuditLog.objects.exists()


@pytest.mark.parametrize("reason", ["", "   "])
def test_a_reason_is_required(alice, v2, reason):
    with pytest.raises(BadRequest, match="reason is required"):
        candidate_promote(v2, alice, "approve", reason)
    assert state(v2) == "awaiting_approval"


def test_the_two_person_rule_stops_the_trainer_approving_alone(alice, django_user_model, creds, v1, v2):
    gate_policy_update(v2.project, alice, "two people sign off", two_person_rule=True)
    TrainingRun.objects.create(project=v2.project, base_version=v1, candidate=v2, started_by=alice)
    with pytest.raises(Forbidden, match="alice started run"):
        candidate_promote(v2, alice, "approve", "my run is good")
    assert state(v2) == "awaiting_approval"
    assert AuditLog.objects.filter(action="approve_refused", actor="alice").exists()
    dave = member(django_user_model.objects.create_user("dave", password="dave-password-1"), creds.project,
                  "approver")
    candidate_promote(v2, dave, "approve", "second pair of eyes")
    assert state(v2) == "production"


def test_without_the_rule_the_trainer_may_approve(alice, v1, v2):
    TrainingRun.objects.create(project=v2.project, base_version=v1, candidate=v2, started_by=alice)
    candidate_promote(v2, alice, "approve", "rule is off")
    assert state(v2) == "production"


def test_only_a_version_awaiting_approval_can_be_approved(alice, v1):
    with pytest.raises(Conflict, match="not awaiting approval"):
        candidate_promote(v1, alice, "approve", "again")


def test_reject_ends_a_candidate(alice, v1, v2):
    candidate_promote(v2, alice, "reject", "judge looks gamed")
    assert (state(v2), state(v1)) == ("rejected", "production")


def test_rollback_goes_back_to_the_previous_production_and_to_any_earlier_one(alice, creds, v1, v2):
    candidate_promote(v2, alice, "approve", "v2 is better")
    v3 = PolicyVersion.objects.create(project=creds.project, number=3, parent=v2, state="awaiting_approval")
    candidate_promote(v3, alice, "approve", "v3 is better")
    candidate_promote(v3, alice, "rollback", "users unhappy with v3")
    assert (state(v3), state(v2), state(v1)) == ("retired", "production", "retired")
    candidate_promote(v1, alice, "rollback", "all the way back")
    assert (state(v2), state(v1)) == ("retired", "production")
    lineage = {row["number"]: row for row in version_lineage(creds.project)}
    assert len(lineage[1]["production_since"]) == 1 and len(lineage[2]["production_since"]) == 2
    assert lineage[3]["parent"] == 2


def test_rollback_refuses_a_version_that_never_served(alice, v2):
    with pytest.raises(Conflict, match="never in production"):
        candidate_promote(v2, alice, "rollback", "try it")


def test_the_database_refuses_to_change_or_delete_the_audit_log(alice, v2):
    candidate_promote(v2, alice, "approve", "ship it")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditLog.objects.filter(action="approve").update(reason="nothing to see")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditLog.objects.filter(action="approve").delete()
    assert AuditLog.objects.get(action="approve").reason == "ship it"


def test_production_at_answers_from_the_audit_log(alice, creds, v1, v2):
    AuditLog.objects.create(project=creds.project, actor="seed", action="approve", target=f"policy_version:{v1.id}",
                            after={"version_id": v1.id, "number": 1, "state": "production"}, reason="seed")
    before_v2 = timezone.now()
    candidate_promote(v2, alice, "approve", "v2")
    assert production_at(creds.project, before_v2) == v1
    assert production_at(creds.project, timezone.now()) == v2
    assert production_at(creds.project, before_v2 - timedelta(days=1)) is None


# --- canary -------------------------------------------------------------------------------------


def live_feedback(project, version: int, accepts: int, rejects: int) -> None:
    now = timezone.now().isoformat()
    events = []
    for i in range(accepts + rejects):
        tid = f"v{version}-t{i}"
        events.append(trajectory(tid, policy_version=version, occurred_at=now))
        events.append(feedback(f"{tid}-fb", tid, "accept" if i < accepts else "reject", occurred_at=now))
    feedback_ingest(project, events)


@pytest.fixture
def canary(alice, creds, v1, v2):
    gate_policy_update(creds.project, alice, "canary first", canary_share=0.1, canary_min_events=40)
    candidate_promote(v2, alice, "approve", "start with 10%")
    assert state(v2) == "canary"
    target = serving_target(creds.project.id)
    assert (target.production, target.canary, target.canary_share) == (1, 2, 0.1)
    return v2


def test_a_worse_canary_is_rolled_back_automatically_and_production_is_untouched(creds, v1, canary):
    live_feedback(creds.project, 2, accepts=15, rejects=45)
    live_feedback(creds.project, 1, accepts=45, rejects=15)
    verdict = canary_decide(canary.id)
    assert verdict.decision == "rollback"
    assert (state(canary), state(v1)) == ("rejected", "production")
    row = audit_for_version(canary).last()
    assert (row.action, row.actor) == ("canary_rollback", "system:canary")
    assert CanaryRun.objects.get().outcome == "rollback"
    assert serving_target(creds.project.id).canary is None


def test_a_better_canary_is_promoted_fully(creds, v1, canary):
    live_feedback(creds.project, 2, accepts=50, rejects=10)
    live_feedback(creds.project, 1, accepts=25, rejects=35)
    assert gate_canaries_check_task.apply().get() == {canary.id: "promote"}
    assert (state(canary), state(v1)) == ("production", "retired")
    assert audit_for_version(canary).last().action == "canary_promote"


def test_a_canary_keeps_running_until_it_has_enough_signals(creds, v1, canary):
    live_feedback(creds.project, 2, accepts=1, rejects=9)
    assert canary_decide(canary.id).decision == "continue"
    assert state(canary) == "canary"


def test_a_person_can_roll_a_canary_back(alice, v1, canary):
    candidate_promote(canary, alice, "rollback", "pulling it early")
    assert (state(canary), state(v1)) == ("rejected", "production")
    assert CanaryRun.objects.get().outcome == "rollback"
