"""The application's database role may only INSERT and SELECT on the audit log; the owner migrates.

    .venv/bin/python -m pytest tests/webapp/test_db_roles.py -q

The suite itself connects as the owner (a superuser: embedded, or CI's `postgres`); these tests take
the application's rights with SET ROLE on a role granted by webapp/db_roles.py, as `migrate` does.
"""

from __future__ import annotations

import os
import secrets
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from core.env import ConfigError
from tests.processes import database_url_of
from training.models import AuditLog
from training.versions.chain import audit_chain_verify
from webapp.db_roles import grant_app_role

ROLE = f"flywheel_app_probe_{os.getpid()}"


@pytest.fixture
def app_role(db):
    """A role granted what the application gets (rolled back with the test's transaction)."""
    with connection.cursor() as cur:
        cur.execute(f"CREATE ROLE {ROLE} NOLOGIN")
    grant_app_role(ROLE)
    return ROLE


def _as_app(statement: str, params: list | None = None):
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # TRUNCATE/ALTER wait for no deferred FK check
        cur.execute(f"SET LOCAL ROLE {ROLE}")
        cur.execute(statement, params)


@pytest.mark.parametrize(("statement", "refusal"), [
    ("UPDATE training_auditlog SET reason = 'rewritten'", "permission denied for table training_auditlog"),
    ("DELETE FROM training_auditlog", "permission denied for table training_auditlog"),
    ("TRUNCATE training_auditlog", "permission denied for table training_auditlog"),
    ("TRUNCATE feedback_project CASCADE", "permission denied for table"),
    ("DROP TRIGGER training_auditlog_no_change ON training_auditlog", "must be owner of (table|relation) training_auditlog"),
    ("ALTER TABLE training_auditlog DISABLE TRIGGER ALL", "must be owner of (table|relation) training_auditlog"),
    ("SET session_replication_role = replica", "permission denied to set parameter"),
    ("INSERT INTO django_migrations (app, name, applied) VALUES ('training', 'x', now())",
     "permission denied for table django_migrations"),
])
def test_the_app_role_cannot_change_or_unprotect_the_audit_log(creds, app_role, statement, refusal):
    AuditLog.objects.create(project=creds.project, actor="alice", action="approve", target="policy_version:1")
    with pytest.raises(DatabaseError, match=refusal):
        _as_app(statement)
    assert AuditLog.objects.get().reason == ""


def test_the_app_role_writes_chained_audit_rows_and_does_its_work(creds, app_role):
    from feedback.models import Project
    from feedback.services import project_create

    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL ROLE {app_role}")
        cur.execute("SELECT current_user")
        assert cur.fetchone() == (app_role,)
        rows = [AuditLog.objects.create(project=creds.project, actor="alice", action="approve", target=f"t{i}")
                for i in range(2)]
        assert [r.seq for r in rows] == [1, 2] and rows[1].prev_hash == rows[0].hash
        project_create("Second product", "second")  # rows elsewhere: insert and update
        assert Project.objects.filter(slug="second").update(name="Renamed") == 1
        out = StringIO()
        call_command("audit", "verify", stdout=out)  # SELECT is all `audit verify` needs
        assert "OK: 2 audit rows chained" in out.getvalue()


def test_an_app_role_that_could_drop_the_triggers_is_refused(db):
    with connection.cursor() as cur:
        cur.execute("SELECT current_user")
        owner = cur.fetchone()[0]
        cur.execute(f"CREATE ROLE {ROLE}_member NOLOGIN IN ROLE {connection.ops.quote_name(owner)}")
        cur.execute(f"CREATE ROLE {ROLE}_super NOLOGIN SUPERUSER")
    with pytest.raises(ConfigError, match="is a member of the owner role"):
        grant_app_role(f"{ROLE}_member")
    with pytest.raises(ConfigError, match="is a superuser"):
        grant_app_role(f"{ROLE}_super")
    with pytest.raises(ConfigError, match="does not exist"):
        grant_app_role(f"{ROLE}_missing")


@pytest.mark.django_db(transaction=True)
def test_migrate_runs_as_the_owner_and_grants_the_application_role(settings, creds):
    """DATABASE_URL names the application's login role, DATABASE_OWNER_URL the owner: `migrate`
    connects as the owner, grants the application's role, and the application's role is refused."""
    login, password = f"{ROLE}_login", secrets.token_urlsafe(16)
    default = connection.settings_dict
    owner = dict(default)
    with connection.cursor() as cur:
        cur.execute(f"CREATE ROLE {login} LOGIN PASSWORD '{password}'")  # token_urlsafe: no quotes
    try:
        settings.DATABASE_OWNER = owner
        connection.close()
        default.update(USER=login, PASSWORD=password)
        try:
            call_command("migrate", verbosity=0)
            with connection.cursor() as cur:  # the application's own connection again
                cur.execute("SELECT current_user")
                assert cur.fetchone() == (login,)
        finally:
            connection.close()
            default.update(USER=owner["USER"], PASSWORD=owner["PASSWORD"])
        app_url = database_url_of({**owner, "USER": login, "PASSWORD": password})
        with psycopg.connect(app_url, autocommit=True) as app:
            app.execute("INSERT INTO training_auditlog (project_id, actor, action, target, reason, at) "
                        "VALUES (%s, 'web', 'approve', 't', '', now())", [creds.project.id])
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute("UPDATE training_auditlog SET actor = 'mallory'")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute("TRUNCATE training_auditlog")
        assert audit_chain_verify().rows == 1
    finally:
        connection.close()
        with connection.cursor() as cur:
            cur.execute(f"DROP OWNED BY {login}")
            cur.execute(f"DROP ROLE {login}")
