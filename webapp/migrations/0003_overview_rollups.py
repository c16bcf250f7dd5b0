"""The overview's usefulness per version in TrajectoryHourly (live, live_accepted,
live_accepted_chars), and deletions seen by the rollups: statement-level AFTER DELETE triggers on
the raw tables write the units whose rows went (an erasure, the retention sweep, the admin) to
RollupDirty, in the deleting transaction, for the next refresh to recompute. The watermarks are
forgotten, so the next refresh (beat, every minute) fills the new columns for every hour."""

from django.db import migrations, models

# One function per raw table: the units its deleted rows (the transition table `old`) counted in.
# Hours are truncated in UTC, as the refresh's sessions do (Django's connections are in UTC).
_DIRTY = {
    "feedback_feedbackevent": """
        SELECT o.project_id, 'feedback_hour', date_trunc('hour', o.occurred_at, 'UTC'), NULL::int FROM old o
        UNION SELECT t.project_id, 'trajectory_hour', date_trunc('hour', t.occurred_at, 'UTC'), NULL FROM old o
            JOIN feedback_trajectory t ON t.id = o.trajectory_id WHERE o.signal = 'accept'
        UNION SELECT t.project_id, 'version', NULL, t.policy_version FROM old o
            JOIN feedback_trajectory t ON t.id = o.trajectory_id WHERE o.aspect_labels IS NOT NULL""",
    "feedback_trajectory": """
        SELECT o.project_id, 'trajectory_hour', date_trunc('hour', o.occurred_at, 'UTC'), NULL::int FROM old o""",
    "training_reward": """
        SELECT t.project_id, 'trajectory_hour', date_trunc('hour', t.occurred_at, 'UTC'), NULL::int FROM old o
            JOIN feedback_trajectory t ON t.id = o.trajectory_id""",
    "training_rubricscore": """
        SELECT t.project_id, 'version', NULL::timestamptz, t.policy_version FROM old o
            JOIN feedback_trajectory t ON t.id = o.trajectory_id""",
}


def _trigger_sql(table: str, units: str) -> str:
    return f"""
CREATE FUNCTION {table}_rollup_dirty() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webapp_rollupdirty (project_id, kind, hour, policy_version) {units};
    RETURN NULL;
END $$;
CREATE TRIGGER {table}_rollup_dirty AFTER DELETE ON {table}
    REFERENCING OLD TABLE AS old FOR EACH STATEMENT EXECUTE FUNCTION {table}_rollup_dirty();
"""


def _drop_sql(table: str) -> str:
    return f"DROP TRIGGER IF EXISTS {table}_rollup_dirty ON {table}; DROP FUNCTION IF EXISTS {table}_rollup_dirty();"


def forget_watermarks(apps, schema_editor):
    apps.get_model("webapp", "RollupWatermark").objects.all().delete()


class Migration(migrations.Migration):

    dependencies = [
        ('webapp', '0002_rollups_schedule'),
        ('feedback', '0005_users_data'),
        ('training', '0011_replica_background'),
    ]

    operations = [
        migrations.CreateModel(
            name='RollupDirty',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('project_id', models.BigIntegerField()),
                ('kind', models.CharField(max_length=16)),
                ('hour', models.DateTimeField(null=True)),
                ('policy_version', models.IntegerField(null=True)),
            ],
        ),
        migrations.AddField(
            model_name='trajectoryhourly',
            name='live',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='trajectoryhourly',
            name='live_accepted',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='trajectoryhourly',
            name='live_accepted_chars',
            field=models.FloatField(default=0.0),
        ),
        *[migrations.RunSQL(_trigger_sql(table, units), _drop_sql(table)) for table, units in _DIRTY.items()],
        migrations.RunPython(forget_watermarks, migrations.RunPython.noop),
    ]
