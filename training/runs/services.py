"""Writes of training runs: claiming a project's lineage, liveness, one TrainingStep row per
optimiser step, the candidate registered and handed to the gate.

The work itself is `training.runs.job.run`, which returns its result instead of calling back;
this module owns the run's state around it.

    .venv/bin/python -m pytest tests/training/test_services.py tests/training/test_tasks.py -q
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from core.errors import BadRequest, Conflict
from core.notify import project_event
from core.tasks import enqueue_after_commit
from core.workers import WorkerRef
from feedback.models import Project
from feedback.services import service_account_get
from training.checkpoints.hf_folder import linear_module_names
from training.corpora.config import MidtrainConfig
from training.corpora.selectors import corpus_get
from training.gate.tasks import gate_run_enqueue
from training.lineage.services import erasure_taint_candidate, lineage_record
from training.models import AgentTask, PolicyVersion, RunState, TrainingRun, TrainingStep, VersionState
from training.rewards.selectors import rewarded_trajectories_since
from training.rewards.services import reward_spec_current
from training.rl.config import AdapterConfig
from training.runs import job, midtrain, selectors
from training.runs.settings import RunSettings, Schedule, SettingsInvalid
from training.versions.selectors import policy_get, policy_production, versions_erased_from
from training.versions.services import policy_folder, policy_register

log = logging.getLogger(__name__)

# The service account that starts the runs nobody else starts (the beat's train_maybe, the
# rollout task): the two-person rule counts it as the starter, so it can never approve them.
SCHEDULER_ACCOUNT = "scheduler"


def _setting(name: str) -> float:
    return float(getattr(settings, name))


def training_run_lost_reason(run: TrainingRun, now: datetime | None = None) -> str | None:
    """Why an active run is presumed dead (its worker process is gone, or it stopped beating)."""
    now = now or timezone.now()
    if run.state == RunState.QUEUED:
        waited = (now - run.created_at).total_seconds()
        limit = _setting("FLYWHEEL_TRAIN_QUEUE_TIMEOUT_S")
        return f"no worker picked the run up within {limit:g} s" if waited > limit else None
    ref = WorkerRef.parse(run.worker)
    gone = ref.gone() if ref is not None else None
    if gone:
        return gone
    silent = (now - selectors.training_run_heartbeat(run)).total_seconds()
    limit = _setting("FLYWHEEL_TRAIN_HEARTBEAT_TIMEOUT_S")
    return f"no heartbeat for {silent:.0f} s (limit {limit:g} s)" if silent > limit else None


def training_run_fail(run_id: int, error: str) -> bool:
    """Active -> failed (a conditional UPDATE: a finished run is never overwritten)."""
    updated = TrainingRun.objects.filter(pk=run_id, state__in=selectors.ACTIVE_RUN_STATES).update(
        state=RunState.FAILED, error=error[:10_000], finished_at=timezone.now()
    )
    if updated:
        run = TrainingRun.objects.get(pk=run_id)
        project_event(run.project_id, {"type": "training_failed", "run": run_id, "error": error[:500]})
    return bool(updated)


def training_run_start(
    project: Project, settings: RunSettings | None = None, *, started_by: Any = None, enqueue: bool = True,
) -> tuple[TrainingRun, bool]:
    """Claims the project's lineage: returns (new run, True), or (the active run, False) when one
    is alive. An active run whose worker died is marked failed first, then the new run starts.
    The run is asked to do `settings` (the defaults when None), over the rewarded trajectories
    that arrived since the project's last run.

    `started_by`: the person or service account starting it (recorded for the two-person rule);
    None means the scheduler's service account (`service:scheduler`).

    The project row lock serialises concurrent starts: the second sees the first's run and leaves."""
    settings = settings or RunSettings()
    run_settings_check(project, settings)
    if started_by is None:
        started_by = service_account_get(SCHEDULER_ACCOUNT)
    with transaction.atomic():
        active = _lineage_claim(project)
        if active is not None:
            return active, False
        base = selectors.training_head(project, settings.rl.max_staleness)
        if base is None:
            raise Conflict(f"project {project.slug!r} has no production policy to train from",
                           "Run `manage.py bootstrap_policy --project SLUG` first.")
        previous = selectors.training_run_last(project)
        run = TrainingRun.objects.create(
            project=project, base_version=base, state=RunState.QUEUED, started_by=started_by, settings=settings.to_dict(),
            spec=reward_spec_current(project), data_since=selectors.training_data_since(project, base, previous),
            data_until=timezone.now(),
        )
        if enqueue:
            enqueue_after_commit("training.tasks.train_policy", run.pk)
    project_event(project.pk, {"type": "training_queued", "run": run.pk, "base": base.number})
    return run, True


def run_settings_check(project: Project, settings: RunSettings) -> None:
    """What the settings alone cannot know: agent rollouts need the project's agent tasks, replay
    rollouts its corpus, a LoRA adapter target modules its policy has."""
    adapter_check(project, settings.adapter)
    if settings.agent and not AgentTask.objects.filter(project=project).exists():
        raise BadRequest(f"project {project.slug!r} has no agent tasks to roll out",
                         "Register some: manage.py agent_tasks --project SLUG --add DIR (docs/agents.md).")
    if settings.replay:
        corpus_get(project, settings.replay.get("corpus"))  # a 404 that says how to add one


def adapter_check(project: Project, adapter: AdapterConfig) -> None:
    """A LoRA's target modules must name linear layers of the project's policy (production's:
    every version of a project shares its shape); a 400 lists the ones it has."""
    production = policy_production(project)
    if not adapter.lora or production is None:
        return
    # The names from the safetensors headers (no torch); of an adapter version, its base's (the
    # same layers, and no merge for a check). Materialising a version never seen on this machine
    # does load torch: the folder is usually there already (served or trained from).
    have = linear_module_names(policy_folder(production.adapter_base or production))
    missing = sorted(set(adapter.target_modules) - set(have))
    if missing:
        raise SettingsInvalid([("adapter", f"adapter.target_modules {missing} name no module of "
                                           f"{project.slug!r}'s policy (v{production.number}); its modules: {have}")])


def _lineage_claim(project: Project) -> TrainingRun | None:
    """Inside a transaction: locks the project row and returns its live active run, if any (one
    whose worker died is marked failed first, so the caller may start the next)."""
    Project.objects.select_for_update().get(pk=project.pk)
    active = selectors.training_run_active(project)
    if active is None:
        return None
    reason = training_run_lost_reason(active)
    if reason is None:
        return active
    training_run_fail(active.pk, f"worker lost: {reason}")
    return None


def midtrain_start(project: Project, *, corpus: int | None = None, steps: int | None = None,
                   minutes: float | None = None, from_version: int | None = None, started_by: Any = None,
                   enqueue: bool = True, adapter: Any = None, **options: Any) -> tuple[TrainingRun, bool]:
    """A mid-training run (kind "midtrain") of production, or of version `from_version`, on the
    project's corpus `corpus` (its newest when None): (new run, True), or (the active run, False).
    `options`: the rest of MidtrainConfig (seq_len, batch_size, lr, warmup, seed). Its settings
    are {"midtrain": MidtrainConfig.to_dict(), "adapter": AdapterConfig.to_dict()}; `adapter`: "full"
    (None) or a LoRA's settings, as a RunSettings' `adapter`."""
    chosen = corpus_get(project, corpus)
    adapter = RunSettings.from_dict({"adapter": adapter}).adapter  # a 400 with the fix when refused
    adapter_check(project, adapter)
    try:
        cfg = MidtrainConfig.from_dict({"corpus": chosen.pk, "steps": steps, "minutes": minutes, **options})
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc), 'E.g. {"minutes": 5} or {"steps": 3000, "lr": 0.001}.') from exc
    if started_by is None:
        started_by = service_account_get(SCHEDULER_ACCOUNT)
    with transaction.atomic():
        active = _lineage_claim(project)
        if active is not None:
            return active, False
        base = policy_production(project) if from_version is None else policy_get(project, from_version)
        if base is None:
            what = "production policy" if from_version is None else f"version {from_version}"
            raise Conflict(f"project {project.slug!r} has no {what} to mid-train",
                           "Run `manage.py bootstrap_policy --project SLUG` first, or name a version that exists "
                           "(--from-version N).")
        run = TrainingRun.objects.create(project=project, base_version=base, state=RunState.QUEUED, kind="midtrain",
                                         started_by=started_by,
                                         settings={"midtrain": cfg.to_dict(), "adapter": adapter.to_dict()})
        if enqueue:
            enqueue_after_commit("training.tasks.train_policy", run.pk)
    project_event(project.pk, {"type": "training_queued", "run": run.pk, "base": base.number, "kind": "midtrain"})
    return run, True


def _run_claim(run_id: int, worker: WorkerRef) -> TrainingRun | None:
    """queued -> running for exactly one worker; a redelivered or duplicate task gets None."""
    now = timezone.now()
    claimed = TrainingRun.objects.filter(pk=run_id, state=RunState.QUEUED).update(
        state=RunState.RUNNING, worker=str(worker), started_at=now, heartbeat_at=now
    )
    return TrainingRun.objects.select_related("project", "base_version").get(pk=run_id) if claimed else None


def train_policy(run_id: int, worker: WorkerRef | None = None,
                 on_step: Callable[[TrainingRun, int, dict[str, Any]], None] | None = None) -> TrainingRun:
    """Executes a queued run: samples from the rewarded trajectories, N rl_steps (or, of kind
    midtrain, packed next-token steps on a corpus), one TrainingStep row per step, the candidate
    registered. Any exception fails the run and registers nothing. `on_step(run, step, metrics)`
    after each step's row (a command's progress bar)."""
    run = _run_claim(run_id, worker or WorkerRef.here())
    if run is None:
        log.info("training run %s is not queued any more; leaving it", run_id)
        return TrainingRun.objects.get(pk=run_id)
    project_event(run.project_id, {"type": "training_started", "run": run.pk, "worker": run.worker})
    folder = staging_dir(run)
    beating = training_run_heartbeat_start(run.pk)
    try:

        def record(step: int, planned: int, metrics: dict[str, Any]) -> None:
            training_step_record(run, step, metrics, planned)
            if on_step is not None:
                on_step(run, step, metrics)

        result = (midtrain.run if run.kind == "midtrain" else job.run)(run, folder, on_step=record)
        training_run_finish(run, folder, result)
    except Exception as exc:  # noqa: BLE001 - every failure must end the run, with its reason
        log.exception("training run %s failed", run_id)
        training_run_fail(run.pk, f"{type(exc).__name__}: {exc}")
    finally:
        beating.set()
        staging_drop(folder)
    return TrainingRun.objects.get(pk=run_id)


def training_run_heartbeat_start(run_id: int) -> threading.Event:
    """Beats for the running run from a thread (a step may outlast the heartbeat timeout);
    setting the returned event stops it. The sweeper fails a run that stopped beating."""
    stop = threading.Event()
    every = _setting("FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S")

    def beat() -> None:
        try:
            while not stop.wait(every):
                TrainingRun.objects.filter(pk=run_id, state=RunState.RUNNING).update(heartbeat_at=timezone.now())
        except Exception:  # noqa: BLE001 - a missed beat is the sweeper's signal, not a crash
            log.warning("training run %s: heartbeat failed", run_id, exc_info=True)
        finally:
            connection.close()  # the thread's own connection

    threading.Thread(target=beat, name=f"run-{run_id}-heartbeat", daemon=True).start()
    return stop


STEP_METRICS = ("loss", "kl_ref", "entropy", "clip_fraction", "grad_norm", "reward_mean", "tokens_per_s")
STEP_DRIFTS = ("mismatch_kl", "staleness_kl")  # None when the step had no row of that kind


def training_step_record(run: TrainingRun, step: int, metrics: dict[str, Any], steps_total: int) -> None:
    drifts = {k: None if metrics.get(k) is None else float(metrics[k]) for k in STEP_DRIFTS}
    TrainingStep.objects.create(
        run=run, step=step, **{k: float(metrics[k]) for k in STEP_METRICS}, **drifts,
        dropped_stale=int(metrics["dropped_stale"]),
    )
    progress = float(metrics.get("progress", (step + 1) / steps_total))  # a run bounded by minutes says it
    TrainingRun.objects.filter(pk=run.pk).update(progress=progress)
    project_event(run.project_id, {"type": "training_step", "run": run.pk, "step": step, "progress": progress,
                                   **{k: metrics[k] for k in STEP_METRICS}, **drifts})


class RunLost(RuntimeError):
    """The run was marked failed (presumed dead) while this worker still ran it."""


def mismatch_flag(result: dict[str, Any]) -> str:
    """Why a run's candidate must not be gated: its data disagreed with the weights that served it."""
    kl, limit = result.get("fresh_mismatch_kl"), float(settings.FLYWHEEL_MISMATCH_KL_MAX)
    if kl is None or kl <= limit:
        return ""
    return (f"flagged: train/inference mismatch KL {kl:.4f} nats on {result.get('fresh_samples')} samples served by "
            f"the base weights (limit {limit:g}); the candidate was not gated")


def region_flag(result: dict[str, Any]) -> str:
    """Why a run's candidate must not be gated: the run left its trust region in its first measured
    round, so it went back to its base's weights and has nothing new to show the gate."""
    if result.get("stopped_after_round") != 1:
        return ""
    why = (f"KL {result['kl_by_round']['1']:.2f} > {result['kl_stop']:g}" if result.get("stopped_by") == "kl" else
           f"length ratio {result['length_ratio_by_round']['1']:.2f} outside 1/{result['length_stop']:g}"
           f"-{result['length_stop']:g}")
    return (f"flagged: left its trust region to production at round 1 ({why}), before any round measured inside;"
            " the candidate is its base's weights and was not gated")


def training_run_finish(run: TrainingRun, folder: Path, result: dict[str, Any]) -> PolicyVersion:
    """Registers the candidate and marks the run succeeded, together or not at all, with the
    lineage of the data it trained on (`trained_on`, popped from `result`). A candidate that must
    not be gated keeps the reason in result["flag"]; every other one is gated."""
    trained_on = result.pop("trained_on", [])
    with transaction.atomic():
        owned = TrainingRun.objects.filter(pk=run.pk, state=RunState.RUNNING).select_for_update().first()
        if owned is None:
            raise RunLost(f"run {run.pk} is no longer running here; its candidate is discarded")
        candidate = policy_register(
            run.project, folder, parent=run.base_version, state=VersionState.CANDIDATE,
            config={"run": run.pk, "kind": run.kind, "base": run.base_version.number,
                    **{k: run.settings[k] for k in ("rl", "midtrain", "adapter") if k in run.settings}},
            adapter_base=adapter_base_of(run, folder),
        )
        flag = erasure_taint_candidate(run, candidate) or mismatch_flag(result) or region_flag(result)
        TrainingRun.objects.filter(pk=run.pk).update(
            state=RunState.SUCCEEDED, candidate=candidate, progress=1.0, finished_at=timezone.now(),
            result={**result, **({"flag": flag} if flag else {})},
        )
        lineage_record(run, trained_on)
        if not flag:  # the candidate goes to the evaluation gate (queue `gate`) once this commits
            gate_run_enqueue(candidate.pk)
    project_event(run.project_id, {"type": "training_succeeded", "run": run.pk, "candidate": candidate.number})
    return candidate


def adapter_base_of(run: TrainingRun, folder: Path) -> PolicyVersion | None:
    """The version a LoRA run's candidate is an adapter over (training.runs.job.setup_policy
    trained it over that base): the base version's own base when it is an adapter, else the base
    version. None: the run trained full weights."""
    if not (folder / "adapter_config.json").is_file():
        return None
    return run.base_version.adapter_base or run.base_version


def train_maybe(project: Project, schedule: Schedule | None = None) -> TrainingRun | None:
    """Starts a run (with `schedule.run`) when >= `schedule.min_new` rewarded trajectories arrived
    since the last run, or when `schedule.every_minutes` passed since it and at least one did (the
    first run always waits for min_new). Returns the new run or None."""
    schedule = schedule or Schedule()
    if policy_production(project) is None:
        return None
    last = selectors.training_run_last(project, tuple(RunState))
    since = last.data_until if last else None
    if last is not None and last.state == RunState.SUCCEEDED and versions_erased_from(project, policy="retrain"):
        # After an erasure under "retrain", what the versions left behind had learned counts as new.
        head = selectors.training_head(project, schedule.run.rl.max_staleness)
        since = selectors.training_data_since(project, head, last) if head is not None else since
    new = rewarded_trajectories_since(project, reward_spec_current(project), since).count()
    # The clock runs from the last run: a project's first run waits for min_new (a first run on a
    # handful of clicks would only occupy the gate).
    due = last is not None and timezone.now() - last.created_at >= timedelta(minutes=schedule.every_minutes)
    if new >= schedule.min_new or (due and new > 0):
        run, created = training_run_start(project, schedule.run, started_by=service_account_get(SCHEDULER_ACCOUNT))
        return run if created else None
    return None


def staging_dir(run: TrainingRun) -> Path:
    root = Path(settings.VAR_DIR) / "staging"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f"run-{run.pk}-"))


def staging_drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
