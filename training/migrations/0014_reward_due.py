"""The reward queue's due rows (training.models.RewardDue) and the triggers that write them.

Statement-level triggers with transition tables: one row per statement that stored trajectories
(their ids), stored feedback linked to a trajectory, linked earlier feedback to one (ingest's
late trajectories, feedback_link_orphans: to be scored again whatever their reward's age), or
deleted a reward quarantine (the admin's retry).
Nothing per row: a 1,000-event batch adds one due row.
"""

import django.contrib.postgres.fields
import django.db.models.deletion
from django.db import migrations, models


TRIGGERS = """
CREATE FUNCTION flywheel_due_trajectories() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO training_rewarddue (project_id, trajectory_ids, at)
    SELECT project_id, array_agg(id), max(received_at) FROM due_new GROUP BY project_id;
    RETURN NULL;
END $$;
CREATE TRIGGER reward_due_trajectory AFTER INSERT ON feedback_trajectory
    REFERENCING NEW TABLE AS due_new FOR EACH STATEMENT EXECUTE FUNCTION flywheel_due_trajectories();

CREATE FUNCTION flywheel_due_feedback_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO training_rewarddue (project_id, trajectory_ids, at)
    SELECT project_id, array_agg(DISTINCT trajectory_id), max(received_at) FROM due_new
    WHERE trajectory_id IS NOT NULL GROUP BY project_id;
    RETURN NULL;
END $$;
CREATE TRIGGER reward_due_feedback_insert AFTER INSERT ON feedback_feedbackevent
    REFERENCING NEW TABLE AS due_new FOR EACH STATEMENT EXECUTE FUNCTION flywheel_due_feedback_insert();

-- A link made later (the feedback came first): due from the later of the two's arrival, the
-- clock every other row uses (the web's, not the database's), and scored again even if its
-- reward is newer than the feedback's arrival (it was computed without it).
CREATE FUNCTION flywheel_due_feedback_link() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO training_rewarddue (project_id, trajectory_ids, at, rescore)
    SELECT n.project_id, array_agg(DISTINCT n.trajectory_id), greatest(max(n.received_at), max(t.received_at)),
           true
    FROM due_new n JOIN due_old o ON o.id = n.id JOIN feedback_trajectory t ON t.id = n.trajectory_id
    WHERE o.trajectory_id IS DISTINCT FROM n.trajectory_id GROUP BY n.project_id;
    RETURN NULL;
END $$;
CREATE TRIGGER reward_due_feedback_link AFTER UPDATE ON feedback_feedbackevent
    REFERENCING OLD TABLE AS due_old NEW TABLE AS due_new FOR EACH STATEMENT
    EXECUTE FUNCTION flywheel_due_feedback_link();

-- A reward quarantine deleted (the admin's retry): its trajectory is offered again.
CREATE FUNCTION flywheel_due_quarantine_release() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO training_rewarddue (project_id, trajectory_ids, at)
    SELECT project_id, array_agg(DISTINCT trajectory_id), now() FROM due_old
    WHERE kind = 'reward' AND trajectory_id IS NOT NULL GROUP BY project_id;
    RETURN NULL;
END $$;
CREATE TRIGGER reward_due_quarantine_release AFTER DELETE ON feedback_quarantine
    REFERENCING OLD TABLE AS due_old FOR EACH STATEMENT EXECUTE FUNCTION flywheel_due_quarantine_release();
"""

REVERSE = """
DROP TRIGGER reward_due_quarantine_release ON feedback_quarantine;
DROP TRIGGER reward_due_feedback_link ON feedback_feedbackevent;
DROP TRIGGER reward_due_feedback_insert ON feedback_feedbackevent;
DROP TRIGGER reward_due_trajectory ON feedback_trajectory;
DROP FUNCTION flywheel_due_quarantine_release();
DROP FUNCTION flywheel_due_feedback_link();
DROP FUNCTION flywheel_due_feedback_insert();
DROP FUNCTION flywheel_due_trajectories();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('feedback', '0009_feedback_trajectory_index_linked_only'),
        ('training', '0013_replica_adapters_probe'),
    ]

    operations = [
        migrations.AddField(
            model_name='rewardspec',
            name='full_pass_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='RewardDue',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('trajectory_ids', django.contrib.postgres.fields.ArrayField(base_field=models.BigIntegerField(), size=None)),
                ('at', models.DateTimeField()),
                ('rescore', models.BooleanField(db_default=False, default=False)),
                ('project', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='feedback.project')),
            ],
            options={
                'indexes': [models.Index(fields=['project', 'at'], name='rewarddue_project_at')],
            },
        ),
        migrations.RunSQL(TRIGGERS, REVERSE),
    ]
