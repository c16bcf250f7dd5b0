"""Rewards, policy versions, training runs, gate reports and the audit log."""

from __future__ import annotations

from django.conf import settings as django_settings
from django.contrib.postgres.fields import ArrayField
from django.db import models

from feedback.models import Project, Trajectory
from training.gate.config import GateThresholds, SuiteSpec


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
    # When the reward queue last went over every trajectory of the project under this spec and
    # found less than a pass's worth to score (NULL: never; a new or edited spec starts there).
    full_pass_at = models.DateTimeField(null=True, blank=True)
    # Where the full pass under way has reached: the last trajectory id (external, the project's
    # unique key) it went past; NULL: the next full pass starts from the first.
    full_pass_cursor = models.TextField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "version"], name="uniq_rewardspec_version")]

    def __str__(self) -> str:
        return f"{self.project.slug} reward spec v{self.version}"


class RewardDue(models.Model):
    """Trajectories whose reward may be missing or stale: one row per statement that stored
    trajectories, linked feedback to one, or released a quarantined one, written by the database's
    own triggers (migration 0014) in that statement's transaction, so nothing stored escapes it
    whoever wrote it. `at` is the newest activity among them (their received_at); the reward queue
    reads a row once that time has settled, scores what is pending among its trajectories and
    deletes it (training.rewards.services.rewards_compute_pending): a pass costs the project's new
    work, not its history."""

    # No constraint: a trigger may write here while Django deletes the project (its quarantine first).
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+", db_constraint=False,
                                db_index=False)
    trajectory_ids = ArrayField(models.BigIntegerField())
    at = models.DateTimeField()
    # Scored again even when their reward is newer than their feedback: feedback linked after its
    # reward was computed (it arrived first, and its trajectory's batch raced it).
    rescore = models.BooleanField(default=False, db_default=False)

    class Meta:
        indexes = [models.Index(fields=["project", "at"], name="rewarddue_project_at")]


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


class VersionState(models.TextChoices):
    """A policy version's life: trained (or bootstrapped) as a candidate, gated, approved (through a
    canary or straight), served, retired when replaced; rejected anywhere before it serves.
    `PolicyVersion.TRANSITIONS` says which moves exist."""

    TRAINING = "training", "training"
    CANDIDATE = "candidate", "candidate"
    GATED = "gated", "gated"
    AWAITING_APPROVAL = "awaiting_approval", "awaiting approval"
    CANARY = "canary", "canary"
    PRODUCTION = "production", "production"
    REJECTED = "rejected", "rejected"
    RETIRED = "retired", "retired"


class RunState(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"


class ReplicaState(models.TextChoices):
    SERVING = "serving", "serving"
    STOPPED = "stopped", "stopped"


class PolicyVersion(models.Model):
    STATES = VersionState.choices
    # The moves `version_transition` makes (training/versions/services.py refuses any other):
    # a candidate is gated (or installed as a base policy), a gate ends awaiting approval or
    # rejected (or lost: a candidate again), an approval starts a canary or serves, a served version
    # retires when replaced and serves again on a rollback to it.
    TRANSITIONS: dict[str, frozenset[str]] = {
        VersionState.TRAINING: frozenset({VersionState.CANDIDATE}),
        VersionState.CANDIDATE: frozenset({VersionState.GATED, VersionState.PRODUCTION, VersionState.REJECTED}),
        VersionState.GATED: frozenset({VersionState.CANDIDATE, VersionState.AWAITING_APPROVAL, VersionState.REJECTED}),
        VersionState.AWAITING_APPROVAL: frozenset({VersionState.CANARY, VersionState.PRODUCTION, VersionState.REJECTED}),
        VersionState.CANARY: frozenset({VersionState.PRODUCTION, VersionState.REJECTED}),
        VersionState.PRODUCTION: frozenset({VersionState.RETIRED}),
        VersionState.RETIRED: frozenset({VersionState.PRODUCTION}),
        VersionState.REJECTED: frozenset(),
    }

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="policy_versions")
    number = models.PositiveIntegerField()
    parent = models.ForeignKey("self", on_delete=models.PROTECT, null=True, blank=True, related_name="children")
    state = models.CharField(max_length=32, choices=STATES, default=VersionState.TRAINING)
    manifest_hash = models.CharField(max_length=64, blank=True, default="")
    checkpoint_path = models.CharField(max_length=500, blank=True, default="")
    delta_bytes = models.BigIntegerField(null=True, blank=True)
    delta_ratio = models.FloatField(null=True, blank=True)
    config = models.JSONField(default=dict, blank=True)
    # A LoRA version is an adapter over this version's weights (stored once, by its own row): its
    # checkpoint and delta are the adapter only, `delta_ratio` is adapter bytes / base bytes. Null:
    # a version of full weights.
    adapter_base = models.ForeignKey("self", on_delete=models.PROTECT, null=True, blank=True, related_name="adapters")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "number"], name="uniq_policy_number")]
        indexes = [models.Index(fields=["project", "state"], name="policy_project_state")]

    def __str__(self) -> str:
        return f"{self.project.slug} v{self.number} ({self.state})"

    def can_become(self, state: str) -> bool:
        return state in self.TRANSITIONS.get(self.state, frozenset())


class TrainingRun(models.Model):
    STATES = RunState.choices
    KINDS = [("rl", "rl"), ("midtrain", "midtrain")]  # midtrain: next-token training on a corpus

    kind = models.CharField(max_length=16, choices=KINDS, default="rl")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="training_runs")
    base_version = models.ForeignKey(PolicyVersion, on_delete=models.PROTECT, related_name="runs_from")
    candidate = models.ForeignKey(
        PolicyVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="runs_to"
    )
    state = models.CharField(max_length=16, choices=STATES, default=RunState.QUEUED)
    # What the run was asked to do (training.runs.settings.RunSettings.to_dict()), written once
    # when it is created; what it produced (the job's report, a flag that kept its candidate from
    # the gate) goes to `result` when it succeeds.
    settings = models.JSONField(default=dict)
    result = models.JSONField(default=dict, blank=True)
    # Its data window: the rewards of `spec` on trajectories that arrived in (data_since, data_until]
    # (unless the settings pin trajectory ids). The next run's window starts at this one's end.
    spec = models.ForeignKey("RewardSpec", on_delete=models.SET_NULL, null=True, blank=True, related_name="runs")
    data_since = models.DateTimeField(null=True, blank=True)
    data_until = models.DateTimeField(null=True, blank=True)
    started_by = models.ForeignKey(django_settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")
    error = models.TextField(blank=True, default="")
    progress = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    # Written every FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S by the worker running it (also mid-step).
    heartbeat_at = models.DateTimeField(null=True, blank=True)
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
    # engine mismatch: KL(mu || pi_old) on the rows the run's base weights served (None: no such row)
    mismatch_kl = models.FloatField(null=True)
    # staleness: the same KL on the rows an older version served (None: no such row)
    staleness_kl = models.FloatField(null=True)
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
    """Tamper-evident record of every state change. Triggers refuse UPDATE, DELETE and TRUNCATE, and
    chain each new row to the previous one: `seq` (1, 2, ...), `prev_hash` (the previous row's
    `hash`) and `hash` (SHA-256 of this row and `prev_hash`) are set by the database on INSERT,
    whatever the caller sends (training/migrations/0005_audit_chain.py; `manage.py audit verify`
    checks the chain). The application's role may only INSERT and SELECT here (webapp/db_roles.py).
    """

    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="audit_entries")
    actor = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    at = models.DateTimeField(auto_now_add=True)
    # Set by the chain trigger; db_default makes Django insert DEFAULT and read them back (RETURNING).
    seq = models.BigIntegerField(db_default=0, editable=False)
    prev_hash = models.CharField(max_length=64, db_default="", editable=False)
    hash = models.CharField(max_length=64, db_default="", editable=False)

    class Meta:
        indexes = [models.Index(fields=["project", "-at"], name="audit_project_time")]
        constraints = [models.UniqueConstraint(fields=["seq"], name="audit_chain_seq_unique")]
        permissions = [("approve_promotion", "Can approve, reject and roll back policy versions")]


# --- gated promotion (training.promotion) ----------------------------------------------------------


class GatePolicy(models.Model):
    """Versioned gate thresholds of a project; the newest version is in force. Rows are not edited:
    a change is saved as a new version (the admin does so), so a GateReport's policy stays true."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="gate_policies")
    version = models.PositiveIntegerField()
    thresholds = models.JSONField(default=dict, blank=True)  # training.gate.config.GateThresholds
    two_person_rule = models.BooleanField(default=False)  # who started a run cannot approve it
    canary_share = models.FloatField(default=0.0)  # 0: approval goes straight to production
    canary_min_events = models.PositiveIntegerField(default=100)
    canary_max_events = models.PositiveIntegerField(default=20_000)
    canary_confidence = models.FloatField(default=0.95)
    note = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(django_settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "version"], name="uniq_gatepolicy_version"),
            models.CheckConstraint(condition=models.Q(canary_share__gte=0, canary_share__lt=1),
                                   name="gatepolicy_canary_share_range"),
        ]

    def __str__(self) -> str:
        return f"{self.project.slug} gate policy v{self.version}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        try:
            GateThresholds.from_json(self.thresholds)
        except (TypeError, ValueError) as exc:
            raise ValidationError({"thresholds": str(exc)}) from exc


class EvalSuite(models.Model):
    """A versioned held-out suite: prompts with check inputs, verifiable checks and a judge rubric."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="eval_suites")
    name = models.SlugField(max_length=64, default="default")
    version = models.PositiveIntegerField()
    prompts = models.JSONField(default=list)  # [{"id", "prompt", "context": {...}}]
    checks = models.JSONField(default=list, blank=True)  # [{"name", "weight", **params}]
    judge = models.JSONField(null=True, blank=True)  # make_judge config
    aspects = models.JSONField(default=list, blank=True)  # [{"name", "weight"}]
    n_samples = models.PositiveIntegerField(default=4)
    max_tokens = models.PositiveIntegerField(default=32)
    temperature = models.FloatField(default=1.0)
    seed = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name", "version"], name="uniq_evalsuite_version")]

    def __str__(self) -> str:
        return f"{self.project.slug} suite {self.name} v{self.version}"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        try:
            self.as_spec()
        except (TypeError, ValueError, KeyError) as exc:
            raise ValidationError(str(exc)) from exc

    def as_spec(self):  # -> training.gate.config.SuiteSpec (imported lazily: keeps models light)

        return SuiteSpec.from_json(self.prompts, checks=self.checks, judge=self.judge, aspects=self.aspects,
                                   n_samples=self.n_samples, max_tokens=self.max_tokens,
                                   temperature=self.temperature, seed=self.seed)


class CanaryRun(models.Model):
    """A version served to a share of traffic next to production until the stopping rule decides."""

    OUTCOMES = [("", "running"), ("promote", "promoted"), ("rollback", "rolled back")]

    version = models.ForeignKey(PolicyVersion, on_delete=models.CASCADE, related_name="canaries")
    baseline = models.ForeignKey(PolicyVersion, on_delete=models.PROTECT, related_name="canary_baselines")
    share = models.FloatField()
    rule = models.JSONField(default=dict)  # training.promotion.sequential.CanaryRule in force
    started_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=OUTCOMES, blank=True, default="")
    verdict = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["version"], condition=models.Q(decided_at__isnull=True),
                                    name="one_open_canary_per_version"),
        ]


# --- serving replicas (training.replicas) ----------------------------------------------------------


class ServingReplica(models.Model):
    """A serving process (`manage.py serve_policy`) that registered itself: the address of its
    internal listener, what it serves, when it last beat. Live while its heartbeat is fresher than
    FLYWHEEL_REPLICA_STALE_S and it has not said it stopped; a promotion pushes to live ones only."""

    STATES = ReplicaState.choices

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="replicas")
    address = models.CharField(max_length=300)  # base URL of its internal listener (/internal/push)
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.PositiveIntegerField(null=True, blank=True)
    engine = models.CharField(max_length=32, blank=True, default="")
    state = models.CharField(max_length=16, choices=STATES, default=ReplicaState.SERVING)
    version = models.PositiveIntegerField(null=True, blank=True)  # the production version it serves
    canary = models.PositiveIntegerField(null=True, blank=True)
    canary_share = models.FloatField(default=0.0)
    registered_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    acked_at = models.DateTimeField(null=True, blank=True)  # when it last acknowledged a push
    pushed_bytes = models.BigIntegerField(default=0)  # bytes of the last push it acknowledged
    error = models.TextField(blank=True, default="")  # why the last push failed ("" after an ack)
    # Background rollouts (inference/background.py): at most this many sequences of training runs'
    # group rollouts at once in the room its users leave (0: takes none; serve_policy
    # --background-rollouts); the share of its wall time spent on them between its last two
    # heartbeats, and the rollouts sampled since it started.
    background_slots = models.PositiveIntegerField(default=0)
    background_share = models.FloatField(default=0.0)
    background_rollouts = models.BigIntegerField(default=0)
    # The LoRA adapters its engine holds for this project's versions ([{"role", "version", "name"}];
    # [] when it serves full weights) and how many adapters of other projects share the engine.
    adapters = models.JSONField(default=list, blank=True)
    adapters_other = models.PositiveIntegerField(default=0)
    # The last probe after a swap (training/replicas/probe.py ProbeReport.as_dict(); {} before any):
    # a refused one ("ok": false) is shown on the registry and raised as an alert metric.
    probe = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "address"], name="uniq_replica_address")]
        indexes = [models.Index(fields=["project", "-heartbeat_at"], name="replica_project_beat")]

    def __str__(self) -> str:
        return f"{self.project.slug} replica {self.address}"


class AgentTask(models.Model):
    """A "make these tests pass" task of the project (training.rewards.agents): the files to fix and
    a tests file of `assert` lines among them. Training runs with an `agent` config play G rollouts
    of these; the gate compares candidate and production on them (docs/agents.md)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="agent_tasks")
    name = models.SlugField(max_length=64)
    instruction = models.TextField()
    files = models.JSONField(default=dict)  # {plain file name: text}, the tests file included
    tests = models.CharField(max_length=100, default="test_task.py")  # which of `files` holds the asserts
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="uniq_agenttask_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.project.slug} agent task {self.name}"


# --- corpora (training.corpora) --------------------------------------------------------------------


class Corpus(models.Model):
    """A project's own code (its repository): text files stored content-addressed under
    FLYWHEEL_CORPUS_DIR, a fixed held-out slice of them (by path) kept for evaluation. Rows are not
    edited: adding files again makes a new corpus."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="corpora")
    name = models.CharField(max_length=200)
    heldout_percent = models.PositiveSmallIntegerField(default=10)
    files_count = models.PositiveIntegerField(default=0)
    bytes = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(null=True, blank=True)  # under `tokenizer_version`'s tokenizer
    heldout_tokens = models.BigIntegerField(null=True, blank=True)
    tokenizer_version = models.PositiveIntegerField(null=True, blank=True)
    skipped = models.JSONField(default=list, blank=True)  # [[path, why]] (the first 200)
    created_by = models.ForeignKey(django_settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["project", "-created_at"], name="corpus_project_time")]

    def __str__(self) -> str:
        return f"{self.project.slug} corpus {self.pk} ({self.name})"


class CorpusFile(models.Model):
    corpus = models.ForeignKey(Corpus, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=1000)
    sha256 = models.CharField(max_length=64)  # the blob's name in the store
    bytes = models.PositiveIntegerField()
    lines = models.PositiveIntegerField()
    tokens = models.PositiveIntegerField(null=True, blank=True)
    heldout = models.BooleanField(default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["corpus", "path"], name="uniq_corpusfile_path")]
        ordering = ["corpus_id", "path"]


# --- users' data: lineage and erasures (training.lineage) -------------------------------------------


class IdRanges(models.Field):
    """A PostgreSQL int8multirange of row ids: a set of ids as its sorted, merged [start, end)
    ranges. Written and queried in SQL (training.lineage); read back as its text form."""

    description = "sorted id ranges (int8multirange)"

    def db_type(self, connection) -> str:
        return "int8multirange"


class RunLineage(models.Model):
    """Exactly which trajectories and feedback events a training run trained on (its samples and
    the reward model's labels), as id ranges: a run over 10,000 consecutive ids is one range."""

    run = models.OneToOneField(TrainingRun, on_delete=models.CASCADE, related_name="lineage")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="run_lineages")
    trajectories = IdRanges()
    feedback = IdRanges()
    trajectory_count = models.PositiveIntegerField(default=0)
    feedback_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["project", "run"], name="lineage_project_run")]


class Erasure(models.Model):
    """One user's data erased (training.lineage.services.user_erase). Holds no id nor hash of the
    user: what was removed (counts), the versions that had learned from it and what the project's
    policy did about them (keep | flag | retrain). With retrain, the training lineage continues
    from the newest version that never saw the data (training.runs.selectors.training_head)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="erasures")
    actor = models.CharField(max_length=150)
    policy = models.CharField(max_length=16)
    removed = models.JSONField(default=dict)  # table -> rows removed; files -> paths rewritten
    versions = models.JSONField(default=list)  # ids of the PolicyVersions that learned from the data
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["project", "-created_at"], name="erasure_project_time")]
