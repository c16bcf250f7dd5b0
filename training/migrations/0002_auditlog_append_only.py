from django.db import migrations

# TRUNCATE stays possible for the database owner: test isolation (flush) needs it.
FORWARD = """
CREATE OR REPLACE FUNCTION training_auditlog_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'training_auditlog is append-only: % is not allowed', TG_OP;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER training_auditlog_no_change
    BEFORE UPDATE OR DELETE ON training_auditlog
    FOR EACH ROW EXECUTE FUNCTION training_auditlog_append_only();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS training_auditlog_no_change ON training_auditlog;
DROP FUNCTION IF EXISTS training_auditlog_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("training", "0001_initial")]
    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
