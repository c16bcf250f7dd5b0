"""What the application's database role may do, granted by the owner after every migration.

    python manage.py migrate     # as DATABASE_OWNER_URL's role, then grant_app_role(DATABASE_URL's)

Two roles (settings: DATABASE_URL, DATABASE_OWNER_URL; the embedded PostgreSQL makes `postgres` and
`flywheel_app`): the owner owns the schema, runs migrations and owns the audit log's triggers; the
application's role reads and writes rows, may only INSERT and SELECT on the audit log, and may not
write django_migrations. Not being the owner, it cannot drop or disable the triggers either, so
the audit log is append-only whatever the application does; its hash chain
(training/migrations/0005_audit_chain.py) makes what the owner does visible too.
"""

from __future__ import annotations

from django.db import connections, transaction

from core.env import ConfigError
from training.models import AuditLog


def grant_app_role(role: str, using: str = "default") -> None:
    """Grants `role` row access to every table of the current schema, then takes back UPDATE,
    DELETE and TRUNCATE on the audit log and writes to django_migrations. Idempotent; run by the
    owner after each migration (new tables get their grants there too)."""
    conn = connections[using]
    q = conn.ops.quote_name
    with transaction.atomic(using=using), conn.cursor() as cur:
        _refuse_powerful(cur, role)
        cur.execute("SELECT current_schema()")
        schema, r = q(cur.fetchone()[0]), q(role)
        for sql in (
            f"GRANT USAGE ON SCHEMA {schema} TO {r}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {r}",
            f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {r}",
            f"REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON {q(AuditLog._meta.db_table)} FROM {r}",
            f"REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {q('django_migrations')} FROM {r}",
        ):
            cur.execute(sql)


def _refuse_powerful(cur, role: str) -> None:
    cur.execute("SELECT rolsuper, pg_has_role(rolname, current_user, 'MEMBER') FROM pg_roles WHERE rolname = %s",
                [role])
    row = cur.fetchone()
    if row is None:
        raise ConfigError(f"the application's database role {role!r} (DATABASE_URL) does not exist: create it "
                          "(CREATE ROLE ... LOGIN PASSWORD ...; docs/deployment.md) or fix DATABASE_URL")
    if row[0] or row[1]:
        kind = "a superuser" if row[0] else "a member of the owner role"
        raise ConfigError(f"the application's database role {role!r} (DATABASE_URL) is {kind}: it could drop "
                          "the audit log's triggers; give DATABASE_URL a role of its own (docs/deployment.md)")
