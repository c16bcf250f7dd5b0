"""The audit log becomes a hash chain, and TRUNCATE is refused.

The chain is computed in a BEFORE INSERT trigger, not in the service: every way a row can arrive
(the services, the admin, raw SQL by the application's role) gets chained, and the caller cannot
choose `seq`, `prev_hash` or `hash`. Concurrent inserts cannot fork the chain: the trigger takes
a transaction-level advisory lock (no table privilege needed, so the application's INSERT+SELECT
role can take it) before it reads the last row, and holds it until commit, so the next writer
reads the row this one wrote. That needs READ COMMITTED, where each statement of the trigger
sees a fresh snapshot (the trigger refuses other isolation levels, whose older snapshot could
miss the last row); the unique `seq` makes a fork impossible even so.

`flywheel.allow_audit_truncate = on` lets a role that holds the TRUNCATE privilege (the owner,
never the application's role) truncate the table: the test suite's flush between transactional
tests sets it (tests/_env.py). The owner could drop the trigger anyway; what protects the log
from the application is the privilege (webapp/db_roles.py), and from the owner the chain.
"""

from django.db import migrations, models

LOCK_KEY = 7380407442996552820  # b"flywaudt": the audit chain's advisory lock


def _field(expr: str) -> str:
    # training/audit_chain.py `_field`: '-' for NULL, else '<length>:<text>'.
    return f"CASE WHEN {expr} IS NULL THEN '-' ELSE length({expr})::text || ':' || {expr} END"


def _hash(row: str, seq: str, prev: str) -> str:
    """SQL for the SHA-256 hex of training/audit_chain.py `canonical` over `row`'s columns."""
    lines = ["'flywheel-audit-v1'", f"{seq}::text", prev, f"{row}.project_id::text",
             _field(f"{row}.actor"), _field(f"{row}.action"), _field(f"{row}.target"),
             _field(f"({row}.before)::text"), _field(f"({row}.after)::text"), _field(f"{row}.reason"),
             f"((extract(epoch FROM {row}.at) * 1000000)::bigint)::text"]
    return f"encode(pg_catalog.sha256(convert_to({' || chr(10) || '.join(lines)}, 'UTF8')), 'hex')"


# Rows written before the chain existed are chained in time order.
BACKFILL = f"""
ALTER TABLE training_auditlog DISABLE TRIGGER training_auditlog_no_change;
DO $backfill$
DECLARE
    r record;
    n bigint := 0;
    prev text := repeat('0', 64);
    h text;
BEGIN
    FOR r IN SELECT * FROM training_auditlog ORDER BY at, id LOOP
        n := n + 1;
        h := {_hash("r", "n", "prev")};
        UPDATE training_auditlog SET seq = n, prev_hash = prev, hash = h WHERE id = r.id;
        prev := h;
    END LOOP;
END
$backfill$;
ALTER TABLE training_auditlog ENABLE TRIGGER training_auditlog_no_change;
"""

TRIGGERS = f"""
CREATE FUNCTION training_auditlog_chain() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $chain$
DECLARE
    last_seq bigint;
    last_hash text;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'training_auditlog rows are chained under READ COMMITTED only, not %',
            current_setting('transaction_isolation')
            USING HINT = 'Write audit rows in a READ COMMITTED transaction (Django''s default).';
    END IF;
    PERFORM pg_advisory_xact_lock({LOCK_KEY});
    -- Schema-qualified: a temporary table of the same name must not stand in for the log.
    EXECUTE format('SELECT seq, hash FROM %I.%I ORDER BY seq DESC LIMIT 1', TG_TABLE_SCHEMA, TG_TABLE_NAME)
        INTO last_seq, last_hash;
    NEW.seq := coalesce(last_seq, 0) + 1;
    NEW.prev_hash := coalesce(last_hash, repeat('0', 64));
    NEW.hash := {_hash("NEW", "NEW.seq", "NEW.prev_hash")};
    RETURN NEW;
END
$chain$;
CREATE TRIGGER training_auditlog_chain
    BEFORE INSERT ON training_auditlog
    FOR EACH ROW EXECUTE FUNCTION training_auditlog_chain();

CREATE FUNCTION training_auditlog_no_truncate() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $truncate$
BEGIN
    IF current_setting('flywheel.allow_audit_truncate', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'training_auditlog is append-only: TRUNCATE is not allowed';
END
$truncate$;
CREATE TRIGGER training_auditlog_no_truncate
    BEFORE TRUNCATE ON training_auditlog
    FOR EACH STATEMENT EXECUTE FUNCTION training_auditlog_no_truncate();
"""

DROP_TRIGGERS = """
DROP TRIGGER IF EXISTS training_auditlog_no_truncate ON training_auditlog;
DROP FUNCTION IF EXISTS training_auditlog_no_truncate();
DROP TRIGGER IF EXISTS training_auditlog_chain ON training_auditlog;
DROP FUNCTION IF EXISTS training_auditlog_chain();
"""


class Migration(migrations.Migration):
    dependencies = [("training", "0004_run_heartbeat")]

    operations = [
        migrations.AddField(model_name="auditlog", name="seq",
                            field=models.BigIntegerField(db_default=0, editable=False)),
        migrations.AddField(model_name="auditlog", name="prev_hash",
                            field=models.CharField(db_default="", editable=False, max_length=64)),
        migrations.AddField(model_name="auditlog", name="hash",
                            field=models.CharField(db_default="", editable=False, max_length=64)),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.AddConstraint(model_name="auditlog",
                                 constraint=models.UniqueConstraint(fields=("seq",), name="audit_chain_seq_unique")),
        migrations.RunSQL(TRIGGERS, DROP_TRIGGERS),
    ]
