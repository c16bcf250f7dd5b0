"""Rollup tables of the dashboard: pages read these, never the raw event tables.

Refreshed incrementally by `webapp.tasks.rollups_refresh` (webapp/rollups.py): each refresh
recomputes, from the raw rows, only the (project, hour) or (project, version) units touched since
a watermark, so a refresh is an idempotent upsert and can run any number of times.
"""

from __future__ import annotations

from django.db import models

from feedback.models import Project


class FeedbackHourly(models.Model):
    """Feedback events per project × policy version × hour × signal (version null: orphan)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    policy_version = models.IntegerField(null=True)
    hour = models.DateTimeField()
    signal = models.CharField(max_length=64)
    n = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "hour", "policy_version", "signal"],
                                    name="uniq_feedback_hourly", nulls_distinct=False),
        ]


class TrajectoryHourly(models.Model):
    """Trajectories and their rewards (latest reward spec) per project × version × hour (of the
    trajectory's occurred_at), and the overview's usefulness of its live ones: how many were
    served, how many the users accepted (at least one accept, whenever it came) and the characters
    their accepts kept (the sum of the accepts' values)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    policy_version = models.IntegerField(null=True)
    hour = models.DateTimeField()
    trajectories = models.BigIntegerField()
    rewarded = models.BigIntegerField()
    reward_sum = models.FloatField()
    live = models.BigIntegerField(default=0)
    live_accepted = models.BigIntegerField(default=0)
    live_accepted_chars = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "hour", "policy_version"],
                                    name="uniq_trajectory_hourly", nulls_distinct=False),
        ]


class RubricRollup(models.Model):
    """Score histogram (10 bins over [0, 1]) per project × version × task × tag × aspect × source.

    `tag` "" is the row over all tags; `source` is "judge" (RubricScore) or "human"
    (FeedbackEvent.aspect_labels); bin -1 counts judge failures (score null)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    policy_version = models.IntegerField(null=True)
    task = models.CharField(max_length=100)
    tag = models.CharField(max_length=100)
    aspect = models.CharField(max_length=64)
    source = models.CharField(max_length=8)
    bin = models.SmallIntegerField()
    n = models.BigIntegerField()
    score_sum = models.FloatField()

    class Meta:
        indexes = [models.Index(fields=["project", "tag", "task"], name="rubric_rollup_filter")]


class AgreementRollup(models.Model):
    """Judge vs human per aspect: pairs (same trajectory), agreements (|judge − human| ≤ 0.2)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    policy_version = models.IntegerField(null=True)
    task = models.CharField(max_length=100)
    tag = models.CharField(max_length=100)
    aspect = models.CharField(max_length=64)
    pairs = models.BigIntegerField()
    agree = models.BigIntegerField()
    abs_err_sum = models.FloatField()

    class Meta:
        indexes = [models.Index(fields=["project", "tag", "task"], name="agreement_rollup_filter")]


class RollupDirty(models.Model):
    """A unit whose raw rows were deleted (an erasure, the admin; not the retention sweep: rollups
    outlive retention, migration 0004), written by the delete triggers of migration 0003 in the
    deleting transaction; the next refresh recomputes
    the unit and deletes the row. kind: "feedback_hour" and "trajectory_hour" (`hour` set) or
    "version" (`policy_version`, null for rows of no version)."""

    project_id = models.BigIntegerField()
    kind = models.CharField(max_length=16)
    hour = models.DateTimeField(null=True)
    policy_version = models.IntegerField(null=True)


class RollupWatermark(models.Model):
    """Where the last refresh got to in one source table: an id (append-only tables) or a time
    (rewards, which are recomputed in place)."""

    name = models.CharField(max_length=64, primary_key=True)
    last_id = models.BigIntegerField(default=0)
    at = models.DateTimeField(null=True)
    refreshed_at = models.DateTimeField(auto_now=True)
