"""The evaluation gate: a candidate against production on the project's held-out suite, with
verifiable checks, the judge, paired intervals and reward-hacking detectors → GateReport, and
the version moves to awaiting_approval (pass) or rejected (fail), audited.

    .venv/bin/python -m pytest tests/training/gate/test_gate_evaluate.py tests/training/gate/test_gate_engine.py -q
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.errors import Conflict
from core.workers import WorkerRef
from feedback.models import Project
from training.corpora.selectors import corpus_heldout_texts
from training.gate.config import GateThresholds, SuiteSpec
from training.gate.corpus_rows import corpus_rows, midtrain_adjusted
from training.gate.defaults import BaseMeasure, base_measure
from training.gate.runner import (
    CheckRow,
    SuiteSamples,
    agent_collect,
    agent_row,
    evaluate,
    suite_collect,
    suite_sample,
)
from training.gate.selectors import gate_base_measured, gate_known_names, gate_reference
from training.models import AuditLog, EvalSuite, GatePolicy, GateReport, PolicyVersion, VersionState
from training.promotion.selectors import gate_policy_active, gate_policy_json
from training.rewards.selectors import agent_tasks
from training.rewards.services import accept_predicted
from training.versions.selectors import policy_production
from training.versions.services import (
    Actor,
    policy_folder,
    version_checkpoint_refuse,
    version_locked,
    version_transition,
)

EngineFactory = Callable[[PolicyVersion], Any]


def _finite(value: Any) -> Any:
    # Postgres jsonb refuses NaN/Infinity; an unbounded detector value is reported as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def eval_suite_active(project: Project, name: str = "default") -> EvalSuite:
    suite = EvalSuite.objects.filter(project=project, name=name).order_by("-version").first()
    if suite is None:
        raise Conflict(f"project {project.slug!r} has no eval suite {name!r}",
                       "Create one in the admin (Training › Eval suites) with prompts, checks and a judge.")
    return suite


def default_engine_factory(version: PolicyVersion) -> Any:
    # Imported here: the engines import torch (and vLLM), which only the gate's worker needs.
    from inference.engines import make_engine

    return make_engine(settings.FLYWHEEL_GATE_ENGINE, policy_folder(version), version=version.number)


def gate_run(version_id: int, *, actor: Actor = "system:gate", suite: str = "default",
             engine_factory: EngineFactory | None = None, worker: WorkerRef | None = None) -> GateReport:
    """Evaluate a candidate against production; passes → awaiting_approval, fails → rejected.

    The claim records `worker` in the gate_start audit row: a gate whose worker is gone (or that
    outlived the gate task's time limit) is lost, and is claimed again (see `gate_lost_reason`)."""
    version, baseline = _gate_claim(version_id, actor, worker or WorkerRef.here())
    policy = gate_policy_active(version.project)
    try:
        rows, suite_info, extra = _gate_rows(version, baseline, policy, suite, engine_factory or default_engine_factory)
    except Exception as exc:
        _gate_abort(version.id, actor, exc)
        raise
    return _gate_finish(version.id, baseline, policy, rows, suite_info, actor, extra)


def _gate_claim(version_id: int, actor: Actor, worker: WorkerRef) -> tuple[PolicyVersion, PolicyVersion | None]:
    with transaction.atomic():
        version = version_locked(version_id)
        lost = gate_lost_reason(version) if version.state == VersionState.GATED else None
        if lost:  # a redelivered task whose first worker died under it
            version_transition(version, VersionState.CANDIDATE, actor, "gate_lost", lost)
        if version.state != VersionState.CANDIDATE:
            raise Conflict(f"policy v{version.number} is {version.state}, not a candidate",
                           "Only a candidate is gated; a rejected version needs a new training run.")
        version_transition(version, VersionState.GATED, actor, "gate_start", worker=str(worker))
        baseline = policy_production(version.project_id)
    return version, baseline


def gate_lost_reason(version: PolicyVersion, now: datetime | None = None) -> str | None:
    """Why a version in `gated` has no live gate task: its worker process is gone, or the gate
    started longer ago than the gate task's hard time limit (no task lives past it)."""
    start = (AuditLog.objects.filter(target=f"policy_version:{version.id}", action="gate_start")
             .order_by("-at", "-id").first())
    if start is None:
        return "gated without a gate_start record"
    ref = WorkerRef.parse((start.after or {}).get("worker", ""))
    gone = ref.gone() if ref is not None else None
    if gone:
        return gone
    age = ((now or timezone.now()) - start.at).total_seconds()
    limit = float(settings.FLYWHEEL_GATE_TIME_LIMIT_S)
    return f"the gate started {age:.0f} s ago, past its time limit of {limit:g} s" if age > limit + 60 else None


def _gate_rows(version: PolicyVersion, baseline: PolicyVersion | None, policy: GatePolicy, suite_name: str,
               engine_factory: EngineFactory) -> tuple[list[CheckRow], dict[str, Any], dict[str, Any]]:
    if baseline is None:
        row = CheckRow("baseline", None, None, None, True, "no production version yet: the first one is approved by a person")
        return [row], {}, {}
    suite = eval_suite_active(version.project, suite_name)
    spec = suite.as_spec()
    thresholds = GateThresholds.from_json(policy.thresholds)
    tasks = agent_tasks(version.project)
    midtrain = (version.config or {}).get("kind") == "midtrain"
    reference = gate_reference(version.project) or baseline
    reference = baseline if reference.id == version.id else reference
    known = gate_known_names(version.project, spec)
    engines = [engine_factory(version), engine_factory(baseline)]
    if reference.id != baseline.id:  # production is not the base: the base samples the suite too
        engines.append(engine_factory(reference))
    try:
        samples = suite_collect(spec, engines[0], engines[1], reference=engines[2] if len(engines) > 2 else None)
        base = _base_measured(version.project, reference, suite, spec, samples, engines[-1], known)
        shares = agent_collect(tasks, engines[0], engines[1], thresholds.agent_G, thresholds.seed) if tasks else None
        heldout = corpus_heldout_texts(version.project)
        on_corpus = (corpus_rows(engines[0], engines[1], heldout, thresholds, midtrain) if heldout else None)
    finally:
        for engine in engines:
            getattr(engine, "close", lambda: None)()
    info = {"name": suite.name, "version": suite.version, "prompts": len(suite.prompts),
            "accept": _accept_on_suite(version.project, spec, samples)}
    derived = BaseMeasure.from_dict(base["measure"]).derived()
    base["thresholds"] = {name: derived[name] for name in thresholds.automatic}
    rows = evaluate(samples, thresholds.resolved(derived), known)
    if midtrain:  # its users' reward must not regress; distance from the old base is the point
        rows = midtrain_adjusted(rows, thresholds.resolved(derived))
    if on_corpus is not None:  # the project's corpus: held-out loss and exact continuations
        rows += on_corpus[0]
        info["corpus"] = on_corpus[1]
    if shares is not None:  # the project's agent tasks: candidate vs production tests pass share
        rows.append(agent_row(*shares, thresholds))
        info["agent"] = {"tasks": len(tasks), "G": thresholds.agent_G,
                         **{side: round(sum(map(sum, s.values())) / max(1, sum(map(len, s.values()))), 4)
                            for side, s in zip(("candidate", "production"), shares, strict=True)}}
    return rows, info, {"base": base}


def _base_measured(project: Project, reference: PolicyVersion, suite: EvalSuite, spec: SuiteSpec,
                   samples: SuiteSamples, engine: Any, known: frozenset[str]) -> dict[str, Any]:
    """The base's measurements on this suite: those a previous gate run stored, or measured now on
    its samples of this run (the suite's seed) and of one more seed (training/gate/defaults.py)."""
    key = (f"policy_version:{reference.id}|suite:{suite.name}@{suite.version}|n{spec.n_samples}"
           f"|max_tokens{spec.max_tokens}|T{spec.temperature:g}|seed{spec.seed}")
    stored = gate_base_measured(project, key)
    fresh = stored is None
    if fresh:
        seeds = (spec.seed, spec.seed + 1)
        stored = base_measure([samples.base, suite_sample(spec, engine, seeds[1])], seeds, samples.prompts,
                              known, [b for _, b in samples.intended_logprobs.values()]).as_dict()
    return {"key": key, "reference": {"version": reference.number, "id": reference.id},
            "measured_now": fresh, "measure": stored}


def _accept_on_suite(project: Project, spec: SuiteSpec, samples: SuiteSamples) -> dict[str, Any] | None:
    """The users' accept rate on the held-out suite, candidate and production, as their reward model
    predicts it: informative (the overview shows it per version), not a gate criterion — the
    model is fitted to the very clicks training optimises."""
    prompts = {p.id: p.prompt for p in spec.prompts}
    return accept_predicted(project, {
        side: [(prompts[s.prompt_id], s.text, s.token_ids) for s in getattr(samples, side)]
        for side in ("candidate", "production")})


def _gate_abort(version_id: int, actor: Actor, exc: Exception) -> None:
    # Imported here: kernels.delta imports torch, which the web process never needs.
    from kernels.delta import CheckpointCorrupt

    if isinstance(exc, CheckpointCorrupt):  # its bytes are bad: gating it again cannot help
        version = PolicyVersion.objects.get(pk=version_id)
        version_checkpoint_refuse(version_id, actor, f"policy v{version.number}'s checkpoint is refused: {exc}")
        return
    with transaction.atomic():
        version = version_locked(version_id)
        if version.state == VersionState.GATED:
            version_transition(version, VersionState.CANDIDATE, actor, "gate_error", f"{type(exc).__name__}: {exc}"[:2000])


def _gate_finish(version_id: int, baseline: PolicyVersion | None, policy: GatePolicy, rows: list[CheckRow],
                 suite_info: dict[str, Any], actor: Actor, extra: dict[str, Any] | None = None) -> GateReport:
    passed = all(r.passed for r in rows)
    checks = [{k: _finite(v) for k, v in r.as_dict().items()} for r in rows]
    with transaction.atomic():
        version = version_locked(version_id)
        report = GateReport.objects.create(version=version, baseline=baseline, passed=passed, checks=checks,
                                           policy={**gate_policy_json(policy), "suite": suite_info, **(extra or {})})
        failed = [r.name for r in rows if not r.passed]
        reason = "all checks passed" if passed else f"failed: {', '.join(failed)}"
        if version.state == VersionState.REJECTED:  # rejected while gated (an erasure under "retrain")
            return report
        version_transition(version, VersionState.AWAITING_APPROVAL if passed else VersionState.REJECTED, actor,
                    "gate_pass" if passed else "gate_fail", reason, gate_report=report.id)
    return report
