"""The audit log is a hash chain the database builds and `manage.py audit verify` checks.

    .venv/bin/python -m pytest tests/training/test_audit_chain.py -q
"""

from __future__ import annotations

import importlib
import threading
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, connections, transaction

from tests.processes import database_url_of
from training.audit_chain import GENESIS, ChainRow, row_hash
from training.models import AuditLog
from training.versions.chain import audit_chain_verify


def _write(project, n: int, **fields) -> list[AuditLog]:
    return [AuditLog.objects.create(project=project, actor=fields.get("actor", "alice"), action="approve",
                                    target=f"policy_version:{i}", before={"state": "awaiting_approval"},
                                    after={"state": "production", "note": "ünïcode\n\"quoted\"", "n": i},
                                    reason=fields.get("reason", f"reason {i}"))
            for i in range(n)]


def _as_owner_without_triggers(sql: str, params: list) -> None:
    """What the schema owner (here a superuser) can do: write past the append-only triggers."""
    with connection.cursor() as cur:
        cur.execute("SET LOCAL session_replication_role = replica")  # triggers off, this transaction
        cur.execute(sql, params)
        cur.execute("SET LOCAL session_replication_role = origin")


def _verify() -> str:
    out = StringIO()
    call_command("audit", "verify", stdout=out)
    return out.getvalue()


def test_each_row_carries_the_hash_of_the_previous_one(creds):
    rows = _write(creds.project, 3)
    assert [r.seq for r in rows] == [1, 2, 3]  # read back from the trigger (RETURNING)
    assert rows[0].prev_hash == GENESIS
    assert rows[1].prev_hash == rows[0].hash and rows[2].prev_hash == rows[1].hash
    assert len({r.hash for r in rows}) == 3
    assert "OK: 3 audit rows chained; head seq=3" in _verify()


def test_the_hash_is_recomputed_outside_the_database(creds):
    row = _write(creds.project, 1, reason="why: 12:x\n-")[0]
    before, after = AuditLog.objects.extra(select={"b": "before::text", "a": "after::text"}).values_list(
        "b", "a").get(pk=row.pk)
    values = ChainRow(row.id, row.seq, row.prev_hash, row.hash, row.project_id, row.actor, row.action, row.target,
                      before, after, row.reason, AuditLog.objects.get(pk=row.pk).at)
    assert row_hash(values, 1, GENESIS) == row.hash
    assert row_hash(values, 1, "f" * 64) != row.hash  # the link is part of the hash


def test_a_caller_cannot_choose_the_chain_fields(creds):
    with connection.cursor() as cur:
        cur.execute("INSERT INTO training_auditlog (project_id, actor, action, target, reason, at, seq, prev_hash, hash) "
                    "VALUES (%s, 'mallory', 'approve', 't', '', now(), 99, %s, %s) RETURNING seq, prev_hash",
                    [creds.project.id, "a" * 64, "b" * 64])
        assert cur.fetchone() == (1, GENESIS)
    assert "OK: 1 audit rows" in _verify()


@pytest.mark.parametrize("change", [
    ("UPDATE training_auditlog SET actor = 'mallory' WHERE seq = 2", "altered"),
    ("UPDATE training_auditlog SET after = '{\"state\": \"rejected\"}' WHERE seq = 2", "altered"),
    ("UPDATE training_auditlog SET at = at - interval '1 microsecond' WHERE seq = 2", "altered"),
])
def test_a_row_altered_by_the_owner_is_detected(creds, change):
    rows = _write(creds.project, 4)
    _as_owner_without_triggers(change[0], [])
    with pytest.raises(CommandError, match=rf"broken at row id={rows[1].id} seq=2: .*{change[1]}"):
        _verify()


def test_a_rehashed_row_is_detected_at_the_next_link(creds):
    rows = _write(creds.project, 3)
    forged = ChainRow(rows[1].id, 2, rows[0].hash, "", creds.project.id, "mallory", "approve", rows[1].target,
                      '{"state": "awaiting_approval"}', '{"state": "rejected"}', rows[1].reason,
                      AuditLog.objects.get(pk=rows[1].pk).at)
    _as_owner_without_triggers("UPDATE training_auditlog SET actor = 'mallory', after = %s, hash = %s WHERE seq = 2",
                               ['{"state": "rejected"}', row_hash(forged, 2, rows[0].hash)])
    with pytest.raises(CommandError, match=rf"row id={rows[2].id} seq=3: prev_hash is not the previous row's"):
        _verify()


def test_a_deleted_row_is_detected(creds):
    rows = _write(creds.project, 4)
    _as_owner_without_triggers("DELETE FROM training_auditlog WHERE seq = 2", [])
    with pytest.raises(CommandError, match=rf"row id={rows[2].id} seq=3: seq 3 where 2 was expected .*deleted"):
        _verify()


def test_a_cut_tail_is_detected_against_a_kept_head(creds):
    rows = _write(creds.project, 3)
    head = f"3:{rows[2].hash}"
    call_command("audit", "verify", "--head", head, stdout=StringIO())
    _as_owner_without_triggers("DELETE FROM training_auditlog WHERE seq = 3", [])
    assert "OK: 2 audit rows" in _verify()  # the chain alone cannot see a cut tail
    with pytest.raises(CommandError, match="head seq=3 is missing"):
        call_command("audit", "verify", "--head", head, stdout=StringIO())


@pytest.mark.parametrize("statement", [
    "UPDATE training_auditlog SET reason = 'x'",
    "DELETE FROM training_auditlog",
    "TRUNCATE training_auditlog",
    "TRUNCATE feedback_project CASCADE",
])
def test_update_delete_and_truncate_are_refused_even_for_the_owner(creds, statement):
    _write(creds.project, 1)
    with connection.cursor() as cur:
        cur.execute("SET LOCAL flywheel.allow_audit_truncate = off")  # the suite's flush sets it on
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # TRUNCATE waits for no deferred FK check
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            cur.execute(statement)
    assert AuditLog.objects.count() == 1


def test_a_chain_under_another_isolation_level_is_refused(db):
    """A REPEATABLE READ snapshot could miss the last row (taken before its commit): refused."""
    with psycopg.connect(database_url_of(connection.settings_dict)) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.RaiseException, match="READ COMMITTED only"):
            conn.execute("INSERT INTO training_auditlog (project_id, actor, action, target, reason, at) "
                         "VALUES (1, 'a', 'b', 'c', '', now())")


def test_an_empty_log_verifies(db):
    report = audit_chain_verify()
    assert (report.rows, report.broken, report.head_seq) == (0, None, 0)


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_cannot_fork_the_chain(creds):
    """Eight connections insert at once, each in its own transaction; the advisory lock makes them
    take turns, so seq runs 1..N without a gap or a repeat and every link holds."""
    per_thread, threads, errors = 5, 8, []
    start = threading.Barrier(threads)

    def writer(k: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                with transaction.atomic():
                    AuditLog.objects.create(project_id=creds.project.id, actor=f"w{k}", action="approve",
                                            target=f"t{k}-{i}", after={"i": i})
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    pool = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    assert sorted(AuditLog.objects.values_list("seq", flat=True)) == list(range(1, threads * per_thread + 1))
    report = audit_chain_verify()
    assert report.rows == threads * per_thread and report.broken is None


def test_rows_written_before_the_chain_are_chained_in_time_order(creds):
    """The migration's backfill: rows of an older log get seq, prev_hash and hash by (at, id)."""
    migration = importlib.import_module("training.migrations.0005_audit_chain")
    times = ["2026-11-03", "2026-11-01", "2026-11-02"]
    for n, day in enumerate(times, start=1):  # unchained rows, as before 0005 (seq kept unique)
        _as_owner_without_triggers("INSERT INTO training_auditlog (project_id, actor, action, target, reason, at, "
                                   "seq, prev_hash, hash) VALUES (%s, 'old', 'approve', %s, '', %s, %s, '', '')",
                                   [creds.project.id, day, f"{day}T00:00:00Z", -n])
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # ALTER TABLE waits for no deferred FK check
        cur.execute(migration.BACKFILL)
    assert list(AuditLog.objects.order_by("seq").values_list("target", flat=True)) == sorted(times)
    assert "OK: 3 audit rows" in _verify()
    assert AuditLog.objects.create(project=creds.project, actor="new", action="a", target="t").seq == 4
    assert "OK: 4 audit rows" in _verify()
