"""Rollups outlive retention: the delete triggers of 0003 write no units while the deleting
transaction has set `flywheel.rollups_keep` to 'on' (the retention sweep, feedback/userdata/services.py
`retention_sweep`, sets it around each batch), so the hourly rollups keep the history of raw rows
that expired. Every other delete (an erasure, the admin) still writes its units to RollupDirty, and
the next refresh recomputes them without the deleted rows."""

import importlib

from django.db import migrations

# 0003's units per raw table, unchanged: only the early return is new.
_DIRTY = importlib.import_module("webapp.migrations.0003_overview_rollups")._DIRTY

# The transaction-local setting the retention sweep sets (services.ROLLUPS_KEEP).
_KEEP = "IF current_setting('flywheel.rollups_keep', true) = 'on' THEN RETURN NULL; END IF;"


def _function_sql(table: str, units: str, keep: bool) -> str:
    return f"""
CREATE OR REPLACE FUNCTION {table}_rollup_dirty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_KEEP if keep else ""}
    INSERT INTO webapp_rollupdirty (project_id, kind, hour, policy_version) {units};
    RETURN NULL;
END $$;
"""


class Migration(migrations.Migration):

    dependencies = [
        ('webapp', '0003_overview_rollups'),
    ]

    operations = [
        migrations.RunSQL(_function_sql(table, units, keep=True), _function_sql(table, units, keep=False))
        for table, units in _DIRTY.items()
    ]
