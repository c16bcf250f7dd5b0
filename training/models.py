"""Rewards, policy versions, training runs, gate reports and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from feedback.models import Project, Trajectory


class RewardSpec(models.Model):
    """A versioned reward definition; immutable once a Reward used it (a new version is made)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="reward_specs")
    version = models.PositiveIntegerField()
    signal_rewards = models.JSONField(default=dict)  # signal -> reward
    checks = models.JSONField(default=list, blank=True)  # [{"name", "weight", ...}]
    aspects = models.JSONField(default=list, blank=True)  # [{"name", "weight", "description"}]
    judge = models.JSONField(default=dict, blank=True)  # {"kind": "rule"|"model", ...}
    settle_seconds = models.PositiveIntegerField(default=60)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "version"], name="uniq_rewardspec_version")]

    def __str__(self) -> str:
        return f"{self.project.slug} reward spec v{self.version}"


class Reward(models.Model):
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="rewards")
    spec = models.ForeignKey(RewardSpec, on_delete=models.PROTECT, related_name="rewards")
    total = models.FloatField()
    components = models.JSONField(default=dict)
    computed_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["trajectory", "spec"], name="uniq_reward_per_spec")]
        indexes = [models.Index(fields=["spec", "-computed_at"], name="reward_spec_time")]


class RubricScore(models.Model):
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="rubric_scores")
    aspect = models.CharField(max_length=64)
    score = models.FloatField(null=True, blank=True)  # null when the judge failed (see `error`)
    rationale = models.TextField(blank=True, default="")
    judge = models.CharField(max_length=100)  # judge id and version
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["trajectory", "aspect", "judge"], name="uniq_rubric_score"),
        ]


class PolicyVersion(models.Model):
    STATES = [
        ("training", "training"),
        ("candidate", "candidate"),
        ("gated", "gated"),
        ("awaiting_approval", "awaiting approval"),
        ("canary", "canary"),
        ("production", "production"),
        ("rejected", "rejected"),
        ("retired", "retired"),
    ]

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="policy_versions")
    number = models.PositiveIntegerField()
    parent = models.ForeignKey("self", on_delete=models.PROTECT, null=True, blank=True, related_name="children")
    state = models.CharField(max_length=32, choices=STATES, default="training")
    manifest_hash = models.CharField(max_length=64, blank=True, default="")
    checkpoint_path = models.CharField(max_length=500, blank=True, default="")
    delta_bytes = models.BigIntegerField(null=True, blank=True)
    delta_ratio = models.FloatField(null=True, blank=True)
    config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "number"], name="uniq_policy_number")]
        indexes = [models.Index(fields=["project", "state"], name="policy_project_state")]

    def __str__(self) -> str:
        return f"{self.project.slug} v{self.number} ({self.state})"


class TrainingRun(models.Model):
    STATES = [("queued", "queued"), ("running", "running"), ("succeeded", "succeeded"), ("failed", "failed")]

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="training_runs")
    base_version = models.ForeignKey(PolicyVersion, on_delete=models.PROTECT, related_name="runs_from")
    candidate = models.ForeignKey(
        PolicyVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="runs_to"
    )
    state = models.CharField(max_length=16, choices=STATES, default="queued")
    config = models.JSONField(default=dict)
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")
    error = models.TextField(blank=True, default="")
    progress = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["project", "-created_at"], name="run_project_time")]


class TrainingStep(models.Model):
    run = models.ForeignKey(TrainingRun, on_delete=models.CASCADE, related_name="steps")
    step = models.PositiveIntegerField()
    loss = models.FloatField()
    kl_ref = models.FloatField()
    entropy = models.FloatField()
    clip_fraction = models.FloatField()
    mismatch_kl = models.FloatField()
    grad_norm = models.FloatField()
    reward_mean = models.FloatField()
    tokens_per_s = models.FloatField()
    dropped_stale = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="uniq_run_step")]
        ordering = ["run_id", "step"]


class GateReport(models.Model):
    version = models.ForeignKey(PolicyVersion, on_delete=models.CASCADE, related_name="gate_reports")
    baseline = models.ForeignKey(
        PolicyVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="gate_baselines"
    )
    passed = models.BooleanField()
    checks = models.JSONField(default=list)  # [{"name", "value", "threshold", "interval", "passed"}]
    policy = models.JSONField(default=dict)  # the gate thresholds in force
    created_at = models.DateTimeField(auto_now_add=True)


class AuditLog(models.Model):
    """Append-only record of every state change (a trigger refuses UPDATE and DELETE)."""

    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="audit_entries")
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["project", "-at"], name="audit_project_time")]
        permissions = [("approve_promotion", "Can approve, reject and roll back policy versions")]
