"""Projects, their credentials, and what they send: trajectories, steps, feedback events."""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings
from django.db import models
from django.db.models import Q

from core import secretbox


class Project(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    # Events per minute the ingest endpoint accepts for this project (429 above it).
    rate_limit_per_minute = models.PositiveIntegerField(default=600_000)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


# A service account is a user whose name starts with this (the admin's user forms refuse ':' in
# a username, so no person can take one); it has no password and acts only through its keys.
SERVICE_ACCOUNT_PREFIX = "service:"


class Membership(models.Model):
    """A person's or service account's role in one project: what they see and may decide there.

    viewer: the project's dashboard pages, read API and live pushes. approver: also approves,
    rejects and rolls back its policy versions. admin: an approver who also manages the
    project's members and keys (granted in the admin; every change is audited)."""

    ROLES = [("viewer", "viewer"), ("approver", "approver"), ("admin", "admin")]
    RANK = {"viewer": 0, "approver": 1, "admin": 2}

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=ROLES, default="viewer")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "user"], name="uniq_membership"),
            models.CheckConstraint(condition=Q(role__in=["viewer", "approver", "admin"]), name="membership_role_known"),
        ]

    def __str__(self) -> str:
        return f"{self.user} is {self.role} of {self.project.slug}"


class ApiKey(models.Model):
    SCOPES = ("ingest", "read", "serve", "admin")  # serve: /v1/* of the serving process

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, default="default")
    # The person or service account the key acts as: a decision made with the key is theirs
    # (their role in the project, the two-person rule). A key bound to nobody (a product's
    # ingest key) reads and writes data but decides nothing.
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
                              related_name="api_keys")
    prefix = models.CharField(max_length=16, db_index=True)  # shown in lists; the rest is hashed
    key_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.project.slug})"

    @staticmethod
    def hash_key(raw: str) -> str:
        return hashlib.sha256(raw.encode()).hexdigest()

    def matches(self, raw: str) -> bool:
        return hmac.compare_digest(self.key_hash, self.hash_key(raw))


class WebhookSecret(models.Model):
    """A Standard Webhooks signing secret (`whsec_…`); two may be active during rotation.

    HMAC verification needs the secret itself (it cannot be hashed), so it is stored encrypted
    (core.secretbox, key from the environment) and shown only once, when created."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="webhook_secrets")
    secret_encrypted = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # set on rotation: old secret's grace end
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=~Q(secret_encrypted=""), name="webhook_secret_not_empty")]

    def __str__(self) -> str:
        return f"webhook secret #{self.pk} ({self.project.slug})"

    @property
    def secret(self) -> str:
        return secretbox.decrypt(self.secret_encrypted)

    @secret.setter
    def secret(self, raw: str) -> None:
        if not raw.startswith("whsec_") or len(raw) < 6 + 24:
            raise ValueError("a webhook secret is 'whsec_' followed by at least 24 characters of base64")
        self.secret_encrypted = secretbox.encrypt(raw)


class WebhookDelivery(models.Model):
    """One accepted Standard Webhooks delivery: a replayed `webhook-id` is a duplicate."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="deliveries")
    webhook_id = models.CharField(max_length=255)
    received_at = models.DateTimeField(auto_now_add=True)
    event_count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "webhook_id"], name="uniq_delivery_per_project")]


class Trajectory(models.Model):
    SOURCES = [("live", "live"), ("simulated", "simulated"), ("eval", "eval")]

    # No index of its own: every index below leads with project (one index fewer to write an event).
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="trajectories", db_index=False)
    external_id = models.CharField(max_length=255)
    policy_version = models.IntegerField(null=True, blank=True)
    source = models.CharField(max_length=16, choices=SOURCES, default="live")
    task = models.CharField(max_length=100, blank=True, default="")
    tags = models.JSONField(default=list, blank=True)
    prompt = models.JSONField(default=list)
    extra = models.JSONField(default=dict, blank=True)  # fields beyond the contract, kept verbatim
    # Whose data it is (the person it was served to), hashed like FeedbackEvent.user_hash.
    user_hash = models.CharField(max_length=64, blank=True, default="", db_default="")
    # consent "no_train" at ingest (or the project's default then): stored and shown, never trained on.
    no_train = models.BooleanField(default=False, db_default=False)
    occurred_at = models.DateTimeField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "external_id"], name="uniq_trajectory_per_project"),
        ]
        indexes = [
            models.Index(fields=["project", "user_hash"], name="traj_project_user", condition=~Q(user_hash="")),
            models.Index(fields=["project", "-occurred_at"], name="traj_project_time"),
            models.Index(fields=["project", "policy_version", "-occurred_at"], name="traj_project_version"),
            models.Index(fields=["project", "task", "-occurred_at"], name="traj_project_task"),
            # The overview's newest live suggestions of each version (webapp.usefulness).
            models.Index(fields=["project", "policy_version", "-id"], name="traj_live_version_id",
                         condition=Q(source="live")),
        ]

    def __str__(self) -> str:
        return self.external_id


class Step(models.Model):
    # No index of its own: uniq_step_index leads with trajectory.
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="steps", db_index=False)
    index = models.PositiveIntegerField()
    role = models.CharField(max_length=32)
    content = models.TextField(blank=True, default="")
    tool_calls = models.JSONField(null=True, blank=True)
    token_ids = models.JSONField(null=True, blank=True)
    logprobs = models.JSONField(null=True, blank=True)  # behaviour log-probs, one per token id
    routing = models.JSONField(null=True, blank=True)  # MoE: top-k expert ids per token per layer
    reward = models.FloatField(null=True, blank=True)
    extra = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["trajectory_id", "index"]
        constraints = [models.UniqueConstraint(fields=["trajectory", "index"], name="uniq_step_index")]


class FeedbackEvent(models.Model):
    # No index of its own: every index below leads with project.
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="feedback_events", db_index=False)
    event_id = models.CharField(max_length=255)
    # Feedback may arrive before its trajectory: the external id is kept and the link is made
    # when the trajectory lands (feedback.services._INSERT_TRAJECTORIES; feedback_link_orphans on beat).
    trajectory_external_id = models.CharField(max_length=255)
    # Indexed by fb_trajectory, which holds linked rows only: a look-up of orphans (trajectory IS
    # NULL) can then only take fb_orphans, whatever the planner's statistics say.
    trajectory = models.ForeignKey(
        Trajectory, on_delete=models.CASCADE, null=True, blank=True, related_name="feedback_events", db_index=False
    )
    signal = models.CharField(max_length=64)
    value = models.FloatField(null=True, blank=True)
    step = models.IntegerField(null=True, blank=True)
    user_hash = models.CharField(max_length=64, blank=True, default="")
    no_train = models.BooleanField(default=False, db_default=False)  # consent "no_train" at ingest, as on Trajectory
    aspect_labels = models.JSONField(null=True, blank=True)  # human labels per rubric aspect
    extra = models.JSONField(default=dict, blank=True)
    occurred_at = models.DateTimeField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "event_id"], name="uniq_feedback_per_project")]
        indexes = [
            models.Index(fields=["project", "user_hash"], name="fb_project_user", condition=~Q(user_hash="")),
            models.Index(fields=["project", "-occurred_at"], name="fb_project_time"),
            models.Index(fields=["project", "signal", "-occurred_at"], name="fb_project_signal"),
            models.Index(
                fields=["project", "trajectory_external_id"],
                name="fb_orphans",
                condition=Q(trajectory__isnull=True),
            ),
            models.Index(fields=["trajectory"], name="fb_trajectory", condition=Q(trajectory__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.event_id}: {self.signal}"


class Quarantine(models.Model):
    """An item a queue could not process, set aside with its error so the queue goes on.

    One row per (project, kind, item): a second failure of the same item counts up `failures` and
    keeps the newest error. A quarantined trajectory is not offered to the reward queue again
    until its row is deleted (the admin's delete is the "retry" button)."""

    KINDS = [("reward", "reward"), ("training", "training"), ("rollup", "rollup"), ("serving", "serving")]

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="quarantined")
    kind = models.CharField(max_length=16, choices=KINDS)
    item = models.CharField(max_length=255)  # what was skipped, e.g. "trajectory traj-1"
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, null=True, blank=True,
                                   related_name="quarantined")
    error = models.TextField()
    detail = models.JSONField(default=dict, blank=True)
    failures = models.PositiveIntegerField(default=1)
    first_at = models.DateTimeField(auto_now_add=True)
    last_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "kind", "item"], name="uniq_quarantine_item")]
        indexes = [models.Index(fields=["project", "-last_at"], name="quarantine_project_time")]

    def __str__(self) -> str:
        return f"{self.project.slug} {self.kind}: {self.item}"


# The built-in redactors a new project runs at ingest (feedback.userdata.redaction.BUILTIN):
# e-mail addresses, API keys and tokens, IP addresses. Projects that existed before this default
# kept what they had (redaction off) by a row of their own (migration 0006_redaction_on_by_default).
DEFAULT_REDACTORS = ("email", "api_key", "ipv4", "ipv6")


def default_redactors() -> list[str]:
    return list(DEFAULT_REDACTORS)


class DataPolicy(models.Model):
    """What a project does with its users' data: the consent default, how long raw events are
    kept, what happens to the versions that learned from an erased user, which redactors run at
    ingest. A project without a row has the defaults (`data_policy_of`): every built-in redactor on."""

    CONSENTS = [("train", "train"), ("no_train", "no_train")]
    ERASURE_POLICIES = [("keep", "keep"), ("flag", "flag"), ("retrain", "retrain")]

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="data_policy")
    consent_default = models.CharField(max_length=16, choices=CONSENTS, default="train")
    # Raw events and trajectories older than this are deleted by beat (None: kept for ever).
    retention_days = models.PositiveIntegerField(null=True, blank=True)
    erasure_policy = models.CharField(max_length=16, choices=ERASURE_POLICIES, default="flag")
    redactors = models.JSONField(default=default_redactors, blank=True)  # names of redaction.BUILTIN
    custom_patterns = models.JSONField(default=list, blank=True)  # [{"name", "pattern"}], validated
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(consent_default__in=["train", "no_train"]), name="consent_known"),
            models.CheckConstraint(condition=Q(erasure_policy__in=["keep", "flag", "retrain"]),
                                   name="erasure_policy_known"),
        ]

    def __str__(self) -> str:
        return f"data policy of {self.project.slug}"


class ConsentOptOut(models.Model):
    """A user (by hashed id) who opted out of training: none of their trajectories or feedback is
    trained on from the moment the row exists (feedback.selectors.trainable)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="opt_outs")
    user_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "user_hash"], name="uniq_opt_out"),
            models.CheckConstraint(condition=~Q(user_hash=""), name="opt_out_user_not_empty"),
        ]


class RedactionTally(models.Model):
    """Matches each redactor replaced at ingest, per project (the Data page and /metrics)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="redaction_tallies")
    redactor = models.CharField(max_length=32)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "redactor"], name="uniq_redaction_tally")]
