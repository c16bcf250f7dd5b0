"""Writes of the training app: reward specs and rewards, policy versions, training runs, rollouts.

The RL maths is plain torch in `training.rl`; the checks and judges are in `training.rewards`.
Here they meet the database: which trajectories are scored and trained on, which worker owns a
run, what is recorded per optimiser step, and where the candidate's weights go.

    .venv/bin/python -m pytest tests/training/test_services.py tests/training/test_tasks.py -q
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch
from django.utils import timezone

from feedback.models import FeedbackEvent, Project, Step, Trajectory
from training import selectors
from training.models import PolicyVersion, Reward, RewardSpec, RubricScore, TrainingRun, TrainingStep
from training.rewards.checks import CheckResult, make_check
from training.rewards.judges import AspectScore, Judge, make_judge
from training.rewards.spec import DEFAULT_SIGNAL_REWARDS, RewardSpecData, compute_reward
from training.rl.config import RLConfig
from webapp.embedded import pid_alive
from webapp.errors import BadRequest, Conflict, NotFound
from webapp.notify import project_event

log = logging.getLogger(__name__)

DEFAULT_JUDGE: dict[str, Any] = {"kind": "rule", "aspects": ["style", "concision"]}
DEFAULT_ASPECTS: list[dict[str, Any]] = [
    {"name": "style", "weight": 0.1, "description": "short lines, PEP 8 names"},
    {"name": "concision", "weight": 0.1, "description": "no padding, no repeated lines"},
]
SPEC_FIELDS = ("signal_rewards", "checks", "aspects", "judge", "settle_seconds")
DEFAULT_TRAIN_STEPS = 4
DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_SAMPLES = 4096


def _setting(name: str) -> float:
    return float(getattr(settings, name))


# === reward specs ===============================================================================


def reward_spec_default(project: Project) -> RewardSpec:
    """The project's first spec (Cursor Tab's map, rule-judged style and concision), made once."""
    spec, _ = RewardSpec.objects.get_or_create(
        project=project, version=1,
        defaults={"signal_rewards": dict(DEFAULT_SIGNAL_REWARDS), "checks": [], "aspects": DEFAULT_ASPECTS,
                  "judge": DEFAULT_JUDGE, "settle_seconds": 60},
    )
    return spec


def reward_spec_current(project: Project) -> RewardSpec:
    spec = RewardSpec.objects.filter(project=project).order_by("-version").first()
    return spec if spec is not None else reward_spec_default(project)


def _spec_validate(fields: dict[str, Any]) -> None:
    try:
        RewardSpecData.from_json(fields["signal_rewards"], fields["checks"], fields["aspects"])
        for check in fields["checks"]:
            params = {k: v for k, v in check.items() if k not in ("name", "weight")}
            make_check(check["name"], **params.get("params", params))
        if fields["judge"]:
            _judge_for(fields["judge"], fields["aspects"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadRequest(f"invalid reward spec: {exc}", "Fix the named field; see training/rewards/.") from exc
    if int(fields["settle_seconds"]) < 0:
        raise BadRequest("settle_seconds must be >= 0", "Give the settle window in seconds.")


def reward_spec_update(project: Project, **changes: Any) -> RewardSpec:
    """Edit the current spec; once a Reward used it, the edit becomes a new version instead."""
    unknown = sorted(set(changes) - set(SPEC_FIELDS))
    if unknown:
        raise BadRequest(f"unknown reward spec fields {unknown}", f"Use any of {list(SPEC_FIELDS)}.")
    reward_spec_default(project)
    with transaction.atomic():
        current = RewardSpec.objects.select_for_update().filter(project=project).order_by("-version").first()
        fields = {**{f: getattr(current, f) for f in SPEC_FIELDS}, **changes}
        _spec_validate(fields)
        if not Reward.objects.filter(spec=current).exists():
            RewardSpec.objects.filter(pk=current.pk).update(**fields)
            current.refresh_from_db()
            return current
        return RewardSpec.objects.create(project=project, version=current.version + 1, **fields)


# === rewards ====================================================================================


def _judge_for(config: dict[str, Any], aspects: Sequence[dict[str, Any]]) -> Judge:
    params = dict(config)
    if params.get("kind") == "model" and "aspects" not in params:
        params["aspects"] = {a["name"]: a.get("description", a["name"]) for a in aspects}
    return make_judge(params)


def _texts(trajectory: Trajectory) -> tuple[str, str]:
    """(prompt text, completion text): the last prompt message and the assistant steps."""
    messages = trajectory.prompt or []
    prompt = str(messages[-1].get("content", "")) if messages else ""
    completion = "".join(s.content for s in trajectory.steps.all() if s.role == "assistant")
    return prompt, completion


def _check_context(trajectory: Trajectory) -> dict[str, Any]:
    # Check inputs (code prefix, a test snippet) ride along in the trajectory's extra fields.
    context = trajectory.extra.get("check_context") if isinstance(trajectory.extra, dict) else None
    return dict(context) if isinstance(context, dict) else {}


def _checks_run(spec: RewardSpec, completion: str, context: dict[str, Any]) -> dict[str, CheckResult]:
    out = {}
    for check in spec.checks:
        params = {k: v for k, v in check.items() if k not in ("name", "weight", "params")}
        out[check["name"]] = make_check(check["name"], **{**params, **check.get("params", {})}).run(completion, context)
    return out


def _rubric_save(trajectory: Trajectory, judge_id: str, scores: dict[str, AspectScore]) -> None:
    for aspect, s in scores.items():
        RubricScore.objects.update_or_create(
            trajectory=trajectory, aspect=aspect, judge=judge_id,
            defaults={"score": s.score, "rationale": "" if s.failed else s.rationale,
                      "error": s.rationale if s.failed else ""},
        )


def _reward_one(trajectory: Trajectory, spec: RewardSpec, data: RewardSpecData, judge: Judge | None) -> Reward:
    prompt, completion = _texts(trajectory)
    context = _check_context(trajectory)
    aspect_scores: dict[str, AspectScore] = {}
    if judge is not None:
        result = judge.judge(prompt, completion, context)
        _rubric_save(trajectory, result.judge_id, result.scores)
        aspect_scores = result.scores
    signals = [{"signal": e.signal, "value": e.value} for e in trajectory.feedback_events.all()]
    total, components = compute_reward(data, signals, _checks_run(spec, completion, context), aspect_scores)
    reward, _ = Reward.objects.update_or_create(
        trajectory=trajectory, spec=spec, defaults={"total": total, "components": components}
    )
    return reward


def rewards_compute(trajectory_ids: Iterable[int], spec: RewardSpec) -> list[Reward]:
    """Reward (total + components) and RubricScore rows for each trajectory under `spec`.

    A failed judge aspect is stored with score NULL and its error and left out of the total.
    Recomputing replaces the trajectory's Reward for this spec (computed_at moves on)."""
    data = RewardSpecData.from_json(spec.signal_rewards, spec.checks, spec.aspects)
    judge = _judge_for(spec.judge, spec.aspects) if spec.judge else None
    trajectories = Trajectory.objects.filter(pk__in=list(trajectory_ids)).prefetch_related(
        Prefetch("steps", queryset=Step.objects.order_by("index")),
        Prefetch("feedback_events", queryset=FeedbackEvent.objects.order_by("occurred_at", "id")),
    )
    rewards = []
    for trajectory in trajectories:
        with transaction.atomic():
            rewards.append(_reward_one(trajectory, spec, data, judge))
    return rewards


def rewards_compute_pending(project: Project, limit: int = 1000, now: datetime | None = None) -> int:
    """Scores the trajectories whose feedback settled (and those with late feedback); returns count."""
    spec = reward_spec_current(project)
    pending = selectors.trajectories_reward_pending(project, spec, now or timezone.now())
    ids = list(pending.values_list("pk", flat=True)[:limit])
    if ids:
        rewards_compute(ids, spec)
        project_event(project.pk, {"type": "rewards_computed", "spec": spec.version, "count": len(ids)})
    return len(ids)


# === policy versions ============================================================================


def checkpoint_store() -> Any:
    from training.checkpoints.store import CheckpointStore, make_storage

    return CheckpointStore(make_storage(settings.FLYWHEEL_CHECKPOINT_DIR))


def policy_folder(version: PolicyVersion) -> Path:
    """An HF folder with `version`'s weights (materialised from the store, verified, if needed)."""
    if version.manifest_hash:
        out = Path(settings.VAR_DIR) / "materialised" / version.manifest_hash
        if not (out / "config.json").exists():
            try:
                checkpoint_store().materialise(version.manifest_hash, out)
            except FileExistsError:  # another process materialised it meanwhile
                pass
        return out
    if version.checkpoint_path and Path(version.checkpoint_path).is_dir():
        return Path(version.checkpoint_path)
    raise NotFound(f"policy v{version.number} has no checkpoint on this machine",
                   "Register it with a checkpoint (bootstrap_policy or a training run).")


def policy_register(
    project: Project, folder: str | Path, parent: PolicyVersion | None = None, state: str = "candidate",
    config: dict[str, Any] | None = None,
) -> PolicyVersion:
    """Stores the HF folder in the checkpoint store (a delta against `parent` where it has one)
    and creates the next PolicyVersion of the project."""
    if state not in dict(PolicyVersion.STATES):
        raise BadRequest(f"unknown policy state {state!r}", f"Use one of {[s for s, _ in PolicyVersion.STATES]}.")
    store = checkpoint_store()
    parent_hash = parent.manifest_hash if parent is not None and parent.manifest_hash else None
    manifest_hash = store.put(str(folder), parent_hash=parent_hash, meta={"project": project.slug})
    manifest = store.manifest(manifest_hash)
    with transaction.atomic():
        Project.objects.select_for_update().filter(pk=project.pk).first()  # serialises numbering
        last = PolicyVersion.objects.filter(project=project).order_by("-number").first()
        return PolicyVersion.objects.create(
            project=project, number=(last.number if last else 0) + 1, parent=parent, state=state,
            manifest_hash=manifest_hash, delta_bytes=manifest["blob_bytes"],
            delta_ratio=manifest["blob_bytes"] / max(manifest["raw_bytes"], 1), config=config or {},
        )


# === training runs: claiming and liveness =======================================================


@dataclass(frozen=True)
class WorkerRef:
    """Who executes a run: `kind|node|host|pid|task_id` in TrainingRun.worker."""

    kind: str  # celery | local
    node: str
    host: str
    pid: int
    task_id: str = ""

    def __str__(self) -> str:
        return "|".join([self.kind, self.node, self.host, str(self.pid), self.task_id])[:200]

    @classmethod
    def parse(cls, text: str) -> WorkerRef | None:
        parts = text.split("|")
        if len(parts) != 5 or not parts[3].isdigit():
            return None
        return cls(parts[0], parts[1], parts[2], int(parts[3]), parts[4])

    @classmethod
    def here(cls, kind: str = "local", node: str = "", task_id: str = "") -> WorkerRef:
        return cls(kind, node or kind, socket.gethostname(), os.getpid(), task_id)


def training_run_lost_reason(run: TrainingRun, now: datetime | None = None) -> str | None:
    """Why an active run is presumed dead (its worker process is gone, or it stopped beating)."""
    now = now or timezone.now()
    if run.state == "queued":
        waited = (now - run.created_at).total_seconds()
        limit = _setting("FLYWHEEL_TRAIN_QUEUE_TIMEOUT_S")
        return f"no worker picked the run up within {limit:g} s" if waited > limit else None
    ref = WorkerRef.parse(run.worker)
    if ref is not None and ref.host == socket.gethostname() and not pid_alive(ref.pid):
        return f"worker process {ref.pid} on {ref.host} ({ref.node}) is gone"
    silent = (now - selectors.training_run_heartbeat(run)).total_seconds()
    limit = _setting("FLYWHEEL_TRAIN_HEARTBEAT_TIMEOUT_S")
    return f"no heartbeat for {silent:.0f} s (limit {limit:g} s)" if silent > limit else None


def training_run_fail(run_id: int, error: str) -> bool:
    """Active -> failed (a conditional UPDATE: a finished run is never overwritten)."""
    updated = TrainingRun.objects.filter(pk=run_id, state__in=selectors.ACTIVE_RUN_STATES).update(
        state="failed", error=error[:10_000], finished_at=timezone.now()
    )
    if updated:
        run = TrainingRun.objects.get(pk=run_id)
        project_event(run.project_id, {"type": "training_failed", "run": run_id, "error": error[:500]})
    return bool(updated)


def training_run_start(
    project: Project, *, steps: int = DEFAULT_TRAIN_STEPS, rl: dict[str, Any] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE, trajectory_ids: Sequence[int] | None = None,
    started_by: Any = None, enqueue: bool = True,
) -> tuple[TrainingRun, bool]:
    """Claims the project's lineage: returns (new run, True), or (the active run, False) when one
    is alive. An active run whose worker died is marked failed first, then the new run starts.

    The project row lock serialises concurrent starts: the second sees the first's run and leaves."""
    cfg = RLConfig.from_dict(rl or {})
    with transaction.atomic():
        Project.objects.select_for_update().get(pk=project.pk)
        active = selectors.training_run_active(project)
        if active is not None:
            reason = training_run_lost_reason(active)
            if reason is None:
                return active, False
            training_run_fail(active.pk, f"worker lost: {reason}")
        base = selectors.policy_production(project)
        if base is None:
            raise Conflict(f"project {project.slug!r} has no production policy to train from",
                           "Run `manage.py bootstrap_policy --project SLUG` first.")
        run = TrainingRun.objects.create(
            project=project, base_version=base, state="queued", started_by=started_by,
            config=_run_config(project, cfg, steps, batch_size, trajectory_ids),
        )
        if enqueue:
            from training.tasks import train_policy_task

            transaction.on_commit(lambda: train_policy_task.delay(run.pk))
    project_event(project.pk, {"type": "training_queued", "run": run.pk, "base": base.number})
    return run, True


def _run_config(
    project: Project, cfg: RLConfig, steps: int, batch_size: int, trajectory_ids: Sequence[int] | None
) -> dict[str, Any]:
    if steps < 1 or batch_size < 1:
        raise BadRequest("steps and batch_size must be >= 1", "Give positive numbers.")
    previous = selectors.training_run_last(project)
    return {
        "rl": cfg.to_dict(), "steps": steps, "batch_size": batch_size, "seed": 0,
        "spec": reward_spec_current(project).pk,
        "data_since": previous.config.get("data_until") if previous else None,
        "data_until": timezone.now().isoformat(),
        "trajectory_ids": list(trajectory_ids) if trajectory_ids is not None else None,
    }


def _run_claim(run_id: int, worker: WorkerRef) -> TrainingRun | None:
    """queued -> running for exactly one worker; a redelivered or duplicate task gets None."""
    claimed = TrainingRun.objects.filter(pk=run_id, state="queued").update(
        state="running", worker=str(worker), started_at=timezone.now()
    )
    return TrainingRun.objects.select_related("project", "base_version").get(pk=run_id) if claimed else None


# === training runs: the work ====================================================================


def train_policy(run_id: int, worker: WorkerRef | None = None) -> TrainingRun:
    """Executes a queued run: samples from the rewarded trajectories, N rl_steps, one TrainingStep
    row per step, the candidate registered. Any exception fails the run and registers nothing."""
    run = _run_claim(run_id, worker or WorkerRef.here())
    if run is None:
        log.info("training run %s is not queued any more; leaving it", run_id)
        return TrainingRun.objects.get(pk=run_id)
    project_event(run.project_id, {"type": "training_started", "run": run.pk, "worker": run.worker})
    try:
        from training import trainer_job

        trainer_job.run(run)
    except Exception as exc:  # noqa: BLE001 - every failure must end the run, with its reason
        log.exception("training run %s failed", run_id)
        training_run_fail(run.pk, f"{type(exc).__name__}: {exc}")
    return TrainingRun.objects.get(pk=run_id)


def training_step_record(run: TrainingRun, step: int, metrics: dict[str, Any], steps_total: int) -> None:
    TrainingStep.objects.create(
        run=run, step=step, **{k: float(metrics[k]) for k in (
            "loss", "kl_ref", "entropy", "clip_fraction", "mismatch_kl", "grad_norm", "reward_mean", "tokens_per_s")},
        dropped_stale=int(metrics["dropped_stale"]),
    )
    progress = (step + 1) / steps_total
    TrainingRun.objects.filter(pk=run.pk).update(progress=progress)
    project_event(run.project_id, {"type": "training_step", "run": run.pk, "step": step, "progress": progress,
                                   **{k: metrics[k] for k in ("loss", "kl_ref", "entropy", "clip_fraction", "mismatch_kl",
                                                                "grad_norm", "reward_mean", "tokens_per_s")}})


class RunLost(RuntimeError):
    """The run was marked failed (presumed dead) while this worker still ran it."""


def training_run_finish(run: TrainingRun, folder: Path, extra_config: dict[str, Any]) -> PolicyVersion:
    """Registers the candidate and marks the run succeeded, together or not at all."""
    with transaction.atomic():
        owned = TrainingRun.objects.filter(pk=run.pk, state="running").select_for_update().first()
        if owned is None:
            raise RunLost(f"run {run.pk} is no longer running here; its candidate is discarded")
        candidate = policy_register(
            run.project, folder, parent=run.base_version, state="candidate",
            config={"run": run.pk, "rl": run.config["rl"], "base": run.base_version.number},
        )
        TrainingRun.objects.filter(pk=run.pk).update(
            state="succeeded", candidate=candidate, progress=1.0, finished_at=timezone.now(),
            config={**owned.config, **extra_config},
        )
        # Every candidate goes to the evaluation gate (queue `gate`) once this commits.
        from training.gate.tasks import gate_run_enqueue

        gate_run_enqueue(candidate.pk)
    project_event(run.project_id, {"type": "training_succeeded", "run": run.pk, "candidate": candidate.number})
    return candidate


# === beat =======================================================================================


def train_maybe(
    project: Project, min_new: int = 64, every_minutes: float = 60.0, *, steps: int = DEFAULT_TRAIN_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE, rl: dict[str, Any] | None = None,
) -> TrainingRun | None:
    """Starts a run when >= min_new rewarded trajectories arrived since the last run, or when
    every_minutes passed since it and at least one did. Returns the new run or None.

    `steps`, `batch_size` and `rl` (RLConfig overrides, e.g. {"lr": 1e-3}) go to the run."""
    if selectors.policy_production(project) is None:
        return None
    last = selectors.training_run_last(project, ("succeeded", "failed", "queued", "running"))
    since = datetime.fromisoformat(last.config["data_until"]) if last and last.config.get("data_until") else None
    new = selectors.rewarded_trajectories_since(project, reward_spec_current(project), since).count()
    due = last is None or timezone.now() - last.created_at >= timedelta(minutes=every_minutes)
    if new >= min_new or (due and new > 0):
        run, created = training_run_start(project, steps=steps, batch_size=batch_size, rl=rl)
        return run if created else None
    return None


def training_schedule_install(
    projects: Iterable[Project] | None = None, rewards_every_s: int = 30, train_check_every_s: int = 60,
    min_new: int = 64, every_minutes: float = 60.0, *, steps: int | None = None, batch_size: int | None = None,
    rl: dict[str, Any] | None = None,
) -> list[Any]:
    """Creates or updates the beat entries (django-celery-beat, editable in the admin) per project:
    rewards every `rewards_every_s`, the train check every `train_check_every_s`. Idempotent.

    `steps`, `batch_size` and `rl` (RLConfig overrides) are stored in the train entry's kwargs for
    every run it starts; left out (None), the runs use the defaults."""
    import json

    train_kwargs: dict[str, Any] = {"min_new": min_new, "every_minutes": every_minutes}
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if value is not None:
            if int(value) < 1:
                raise BadRequest(f"{name} must be >= 1", "Give a positive number.")
            train_kwargs[name] = int(value)
    if rl is not None:
        try:
            RLConfig.from_dict(dict(rl))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid RL overrides: {exc}", "Use RLConfig field names and valid values.") from exc
        train_kwargs["rl"] = dict(rl)

    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    def every(seconds: int) -> IntervalSchedule:
        return IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)[0]

    out = []
    for project in projects if projects is not None else Project.objects.all():
        entries = [
            (f"flywheel rewards {project.slug}", "training.tasks.rewards_compute_pending", every(rewards_every_s), {}),
            (f"flywheel train {project.slug}", "training.tasks.train_maybe", every(train_check_every_s),
             train_kwargs),
        ]
        for name, task, interval, kwargs in entries:
            entry, _ = PeriodicTask.objects.update_or_create(
                name=name, defaults={"task": task, "interval": interval, "args": json.dumps([project.pk]),
                                     "kwargs": json.dumps(kwargs), "enabled": True},
            )
            out.append(entry)
    canaries, _ = PeriodicTask.objects.update_or_create(
        name="flywheel canaries", defaults={"task": "training.tasks.gate_canaries_check", "interval": every(60),
                                            "args": "[]", "kwargs": "{}", "enabled": True},
    )
    return [*out, canaries]


# === simulated rollouts =========================================================================


@dataclass(frozen=True)
class RolloutPrompt:
    text: str
    task: str = "rollout"
    check_context: dict[str, Any] | None = None  # e.g. {"tests": "assert add(1, 2) == 3"}

    @classmethod
    def of(cls, item: str | dict[str, Any] | RolloutPrompt) -> RolloutPrompt:
        if isinstance(item, RolloutPrompt):
            return item
        if isinstance(item, str):
            return cls(item)
        return cls(str(item["prompt"]), str(item.get("task", "rollout")), item.get("check_context"))


def _rollout_events(prompts: list[RolloutPrompt], completions: list[Any], G: int, version: int) -> list[dict]:
    batch = uuid.uuid4().hex[:12]
    events = []
    for k, c in enumerate(completions):
        p = prompts[c.prompt_index]
        step = {"role": "assistant", "content": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs}
        if c.routing is not None:
            step["routing"] = c.routing
        events.append({
            "type": "trajectory", "id": f"sim-{batch}-{c.prompt_index}-{k % G}", "policy_version": version,
            "source": "simulated", "task": p.task, "prompt": [{"role": "user", "content": p.text}],
            "steps": [step], "prompt_token_ids": c.prompt_token_ids, "group": f"{batch}-{c.prompt_index}",
            "check_context": p.check_context or {},
        })
    return events


def rollout_and_train(
    project: Project, prompts: Sequence[str | dict[str, Any] | RolloutPrompt], G: int = 16, *,
    steps: int = 1, max_tokens: int = 24, seed: int = 0, rl: dict[str, Any] | None = None,
    engine: Any = None, inline: bool = True,
) -> tuple[TrainingRun, bool]:
    """Samples G completions per prompt from the production policy, records them as simulated
    trajectories (through feedback_ingest), scores them with the current spec's checks and judge,
    and trains on group-relative advantages (inline, or queued for the train workers)."""
    from feedback.services import feedback_ingest
    from inference.engine import SamplingParams, make_engine

    base = selectors.policy_production(project)
    if base is None:
        raise Conflict(f"project {project.slug!r} has no production policy", "Run bootstrap_policy first.")
    pool = [RolloutPrompt.of(p) for p in prompts]
    own = engine is None
    engine = engine or make_engine("torch", policy_folder(base), version=base.number, seed=seed)
    try:
        completions = engine.generate([p.text for p in pool], n=G, sampling=SamplingParams(max_tokens=max_tokens, seed=seed))
    finally:
        if own:
            engine.close()
    events = _rollout_events(pool, completions, G, base.number)
    for start in range(0, len(events), 1000):
        feedback_ingest(project, events[start : start + 1000])
    ids = list(Trajectory.objects.filter(project=project, external_id__in=[e["id"] for e in events]).values_list(
        "pk", flat=True))
    rewards_compute(ids, reward_spec_current(project))
    run, created = training_run_start(project, steps=steps, rl=rl, batch_size=len(ids), trajectory_ids=ids,
                                      enqueue=not inline)
    if created and inline:
        run = train_policy(run.pk)
    return run, created


def staging_dir(run: TrainingRun) -> Path:
    root = Path(settings.VAR_DIR) / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f"run-{run.pk}-"))


def staging_drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
