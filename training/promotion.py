"""Gated promotion: the evaluation gate, approval, canary and rollback of policy versions, and the
reads over their history. Every state change of a version writes an AuditLog row (actor, action,
before, after, reason) in the same transaction and is pushed to the dashboard after commit.

State machine:  candidate → gated → awaiting_approval | rejected
                awaiting_approval → production (or canary → production | rejected) | rejected
                production → retired (replaced) ; retired → production (manual rollback)

Services: gate_run, candidate_promote, canary_decide, canaries_decide_all, gate_policy_update.
Selectors: gate_policy_active, eval_suite_active, version_list, version_get, version_lineage,
production_at, audit_for_version (and training.deploy.serving_target).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any, Literal

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.db.models import Count, Prefetch, Q, QuerySet
from django.utils import timezone

from feedback.auth import Principal
from feedback.models import FeedbackEvent, Project
from training.deploy import deploy_hook
from training.gate import sequential
from training.gate.config import GateThresholds
from training.gate.runner import CheckRow, evaluate, suite_collect
from training.gate.sequential import ArmCounts, CanaryRule, CanaryVerdict
from training.models import AuditLog, CanaryRun, EvalSuite, GatePolicy, GateReport, PolicyVersion, TrainingRun
from webapp.errors import BadRequest, Conflict, Forbidden, NotFound
from webapp.notify import project_event

Actor = AbstractBaseUser | AnonymousUser | Principal | str  # str: a system actor, e.g. "system:canary"
Action = Literal["approve", "reject", "rollback"]
EngineFactory = Callable[[PolicyVersion], Any]

APPROVE_PERMISSION = "training.approve_promotion"
SUCCESS_SIGNALS = ("accept", "happy", "edit_kept")
FAILURE_SIGNALS = ("reject", "sad", "followup_dissatisfied")


# ---------------------------------------------------------------------------------- helpers


def actor_name(actor: Actor) -> str:
    if isinstance(actor, str):
        return actor
    if isinstance(actor, Principal):
        return f"api_key:{actor.project.slug}"
    return actor.get_username() or "anonymous"


def _snapshot(version: PolicyVersion) -> dict[str, Any]:
    return {"version_id": version.id, "number": version.number, "state": version.state}


def _audit(version: PolicyVersion, actor: Actor, action: str, before: dict | None, reason: str = "",
           **after_extra: Any) -> AuditLog:
    return AuditLog.objects.create(
        project_id=version.project_id, actor=actor_name(actor), action=action, target=f"policy_version:{version.id}",
        before=before, after={**_snapshot(version), **after_extra}, reason=reason,
    )


def _transition(version: PolicyVersion, state: str, actor: Actor, action: str, reason: str = "", **extra: Any) -> None:
    before = _snapshot(version)
    version.state = state
    version.save(update_fields=["state", "updated_at"])
    _audit(version, actor, action, before, reason, **extra)
    payload = {"type": "policy_version", "action": action, "version": version.number,
               "before": before["state"], "after": state, "actor": actor_name(actor)}
    transaction.on_commit(lambda: project_event(version.project_id, payload))


def _locked(version_id: int) -> PolicyVersion:
    version = PolicyVersion.objects.select_for_update().filter(id=version_id).first()
    if version is None:
        raise NotFound(f"no policy version {version_id}", "Check the id (GET /api/v1/versions lists them).")
    return version


def _production(project_id: int, *, lock: bool = False) -> PolicyVersion | None:
    qs = PolicyVersion.objects.filter(project_id=project_id, state="production")
    return (qs.select_for_update() if lock else qs).order_by("-updated_at").first()


def base_policy_install(version: PolicyVersion, actor: Actor, reason: str) -> PolicyVersion:
    """Put a base policy (one not produced by a training run, e.g. bootstrap_policy's) straight
    into production, retiring the current one; audited like every other state change."""
    with transaction.atomic():
        version = _locked(version.id)
        current = _production(version.project_id, lock=True)
        if current is not None and current.id != version.id:
            _transition(current, "retired", actor, "retire", reason)
        _transition(version, "production", actor, "install_base", reason)
        _deploy_after_commit(version)
    return version


def _deploy_after_commit(version: PolicyVersion) -> None:
    transaction.on_commit(lambda: deploy_hook(version))


def _finite(value: Any) -> Any:
    # Postgres jsonb refuses NaN/Infinity; an unbounded detector value is reported as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- gate


def gate_policy_active(project: Project) -> GatePolicy:
    """Selector: the newest GatePolicy, or the defaults (unsaved, version 0) when none was set."""
    policy = GatePolicy.objects.filter(project=project).order_by("-version").first()
    return policy or GatePolicy(project=project, version=0)


def gate_policy_update(project: Project, actor: Actor, reason: str = "", **fields: Any) -> GatePolicy:
    """A new version of the project's gate policy: the active one with `fields` changed."""
    with transaction.atomic():
        Project.objects.select_for_update().get(id=project.id)  # serialises version numbers
        current = gate_policy_active(project)
        new = GatePolicy(project=project, version=current.version + 1,
                         **{f: getattr(current, f) for f in _POLICY_FIELDS}, note=reason)
        for name, value in fields.items():
            if name not in _POLICY_FIELDS:
                raise BadRequest(f"unknown gate policy field {name!r}", f"Use one of {sorted(_POLICY_FIELDS)}.")
            setattr(new, name, value)
        new.created_by = actor if isinstance(actor, AbstractBaseUser) else None
        _validate_policy(new)
        new.save()
        AuditLog.objects.create(project=project, actor=actor_name(actor), action="gate_policy_update",
                                target=f"gate_policy:{new.version}", before=_policy_json(current),
                                after=_policy_json(new), reason=reason)
    return new


_POLICY_FIELDS = ("thresholds", "two_person_rule", "canary_share", "canary_min_events", "canary_max_events",
                  "canary_confidence")


def _validate_policy(policy: GatePolicy) -> None:
    try:
        GateThresholds.from_json(policy.thresholds)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"invalid gate thresholds: {exc}", "Fix or drop the named keys.") from exc
    if not 0 <= policy.canary_share < 1:
        raise BadRequest(f"canary_share {policy.canary_share} is outside [0, 1)", "Use 0 for no canary, e.g. 0.1 for 10%.")


def _policy_json(policy: GatePolicy) -> dict[str, Any]:
    return {"version": policy.version, **{f: getattr(policy, f) for f in _POLICY_FIELDS}}


def eval_suite_active(project: Project, name: str = "default") -> EvalSuite:
    suite = EvalSuite.objects.filter(project=project, name=name).order_by("-version").first()
    if suite is None:
        raise Conflict(f"project {project.slug!r} has no eval suite {name!r}",
                       "Create one in the admin (Training › Eval suites) with prompts, checks and a judge.")
    return suite


def default_engine_factory(version: PolicyVersion) -> Any:
    from django.conf import settings

    from inference.engine import make_engine
    from training.services import policy_folder

    return make_engine(settings.FLYWHEEL_GATE_ENGINE, policy_folder(version), version=version.number)


def gate_run(version_id: int, *, actor: Actor = "system:gate", suite: str = "default",
             engine_factory: EngineFactory | None = None) -> GateReport:
    """Evaluate a candidate against production; passes → awaiting_approval, fails → rejected."""
    version, baseline = _gate_claim(version_id, actor)
    policy = gate_policy_active(version.project)
    try:
        rows, suite_info = _gate_rows(version, baseline, policy, suite, engine_factory or default_engine_factory)
    except Exception as exc:
        _gate_abort(version.id, actor, exc)
        raise
    return _gate_finish(version.id, baseline, policy, rows, suite_info, actor)


def _gate_claim(version_id: int, actor: Actor) -> tuple[PolicyVersion, PolicyVersion | None]:
    with transaction.atomic():
        version = _locked(version_id)
        if version.state != "candidate":
            raise Conflict(f"policy v{version.number} is {version.state}, not a candidate",
                           "Only a candidate is gated; a rejected version needs a new training run.")
        _transition(version, "gated", actor, "gate_start")
        baseline = _production(version.project_id)
    return version, baseline


def _gate_rows(version: PolicyVersion, baseline: PolicyVersion | None, policy: GatePolicy, suite_name: str,
               engine_factory: EngineFactory) -> tuple[list[CheckRow], dict[str, Any]]:
    if baseline is None:
        row = CheckRow("baseline", None, None, None, True, "no production version yet: the first one is approved by a person")
        return [row], {}
    suite = eval_suite_active(version.project, suite_name)
    thresholds = GateThresholds.from_json(policy.thresholds)
    engines = [engine_factory(version), engine_factory(baseline)]
    try:
        samples = suite_collect(suite.as_spec(), engines[0], engines[1])
    finally:
        for engine in engines:
            getattr(engine, "close", lambda: None)()
    return evaluate(samples, thresholds), {"name": suite.name, "version": suite.version, "prompts": len(suite.prompts)}


def _gate_abort(version_id: int, actor: Actor, exc: Exception) -> None:
    with transaction.atomic():
        version = _locked(version_id)
        if version.state == "gated":
            _transition(version, "candidate", actor, "gate_error", f"{type(exc).__name__}: {exc}"[:2000])


def _gate_finish(version_id: int, baseline: PolicyVersion | None, policy: GatePolicy, rows: list[CheckRow],
                 suite_info: dict[str, Any], actor: Actor) -> GateReport:
    passed = all(r.passed for r in rows)
    checks = [{k: _finite(v) for k, v in r.as_dict().items()} for r in rows]
    with transaction.atomic():
        version = _locked(version_id)
        report = GateReport.objects.create(version=version, baseline=baseline, passed=passed, checks=checks,
                                           policy={**_policy_json(policy), "suite": suite_info})
        failed = [r.name for r in rows if not r.passed]
        reason = "all checks passed" if passed else f"failed: {', '.join(failed)}"
        _transition(version, "awaiting_approval" if passed else "rejected", actor,
                    "gate_pass" if passed else "gate_fail", reason, gate_report=report.id)
    return report


# ---------------------------------------------------------------------------------- approval


def _may_approve(actor: Actor, project_id: int) -> bool:
    if isinstance(actor, Principal):
        return actor.project.id == project_id and "admin" in actor.scopes
    if isinstance(actor, str):
        return False
    return bool(actor.is_authenticated and actor.is_active and actor.has_perm(APPROVE_PERMISSION))


def _refuse(version: PolicyVersion, actor: Actor, action: str, message: str, fix: str, reason: str) -> Forbidden:
    # Recorded in its own transaction: the refusal must stay on record although the request fails.
    with transaction.atomic():
        _audit(version, actor, f"{action}_refused", _snapshot(version), reason, refused=message)
    return Forbidden(message, fix)


def candidate_promote(version: PolicyVersion | int, actor: Actor, action: Action, reason: str) -> PolicyVersion:
    """approve | reject | rollback a version, as `actor`, for `reason` (required)."""
    version_id = version if isinstance(version, int) else version.id
    current = PolicyVersion.objects.filter(id=version_id).first()
    if current is None:
        raise NotFound(f"no policy version {version_id}", "Check the id (GET /api/v1/versions lists them).")
    if action not in _ACTIONS:
        raise BadRequest(f"unknown action {action!r}", "Use approve, reject or rollback.")
    if not _may_approve(actor, current.project_id):
        raise _refuse(current, actor, action, f"{actor_name(actor)} may not {action} policy versions",
                      "Ask someone with the permission 'training.approve_promotion' (or use an admin key of this project).",
                      reason or "")
    if not (reason or "").strip():
        raise BadRequest("a reason is required", "Say in a sentence why (it is kept in the audit log).")
    if action == "approve":
        _two_person_check(current, actor, reason)
    with transaction.atomic():
        locked = _locked(version_id)
        _ACTIONS[action](locked, actor, reason.strip())
    return PolicyVersion.objects.get(id=version_id)


def _trainer_of(version: PolicyVersion) -> Any:
    run = TrainingRun.objects.filter(candidate=version).select_related("started_by").order_by("-created_at").first()
    return run.started_by if run else None


def _two_person_check(version: PolicyVersion, actor: Actor, reason: str) -> None:
    if not gate_policy_active(version.project).two_person_rule:
        return
    trainer = _trainer_of(version)
    if trainer is not None and isinstance(actor, AbstractBaseUser) and trainer.pk == actor.pk:
        raise _refuse(version, actor, "approve", f"{actor_name(actor)} started the run that trained v{version.number}",
                      "The two-person rule is on: another person with the approval permission must approve.", reason)


def _approve(version: PolicyVersion, actor: Actor, reason: str) -> None:
    if version.state != "awaiting_approval":
        raise Conflict(f"policy v{version.number} is {version.state}, not awaiting approval",
                       "Only a version that passed the gate can be approved.")
    policy = gate_policy_active(version.project)
    production = _production(version.project_id, lock=True)
    if production is not None and policy.canary_share > 0:
        _canary_start(version, production, policy, actor, reason)
    else:
        _make_production(version, production, actor, "approve", reason)


def _make_production(version: PolicyVersion, previous: PolicyVersion | None, actor: Actor, action: str,
                     reason: str) -> None:
    if previous is not None and previous.id != version.id:
        _transition(previous, "retired", actor, "retire", reason, replaced_by=version.number)
    _transition(version, "production", actor, action, reason)
    _deploy_after_commit(version)


def _reject(version: PolicyVersion, actor: Actor, reason: str) -> None:
    if version.state == "canary":
        _canary_close(version, "rollback", None)
    elif version.state != "awaiting_approval":
        raise Conflict(f"policy v{version.number} is {version.state}; only a version awaiting approval or in "
                       "canary can be rejected", "To take a production version out, roll back to an earlier one.")
    _transition(version, "rejected", actor, "reject", reason)
    _deploy_after_commit(version)


def _rollback(version: PolicyVersion, actor: Actor, reason: str) -> None:
    """On a canary: end it. On production: go back to the previous production version. On a
    retired version that was in production: make it production again."""
    if version.state == "canary":
        _canary_close(version, "rollback", None)
        _transition(version, "rejected", actor, "rollback", reason)
        _deploy_after_commit(version)
        return
    current = _production(version.project_id, lock=True)
    if version.state == "production":
        target = _previous_production(version)
        if target is None:
            raise Conflict(f"policy v{version.number} is the first production version", "There is nothing to roll back to.")
    elif version.state == "retired" and _was_production(version):
        target = version
    else:
        raise Conflict(f"policy v{version.number} ({version.state}) was never in production",
                       "Roll back to a version that served before (see GET /api/v1/versions?state=retired).")
    target = PolicyVersion.objects.select_for_update().get(id=target.id)
    _make_production(target, current, actor, "rollback", reason)


_SERVED = Q(after__state="production") | Q(before__state="production")


def _was_production(version: PolicyVersion) -> bool:
    return AuditLog.objects.filter(_SERVED, target=f"policy_version:{version.id}").exists()


def _previous_production(version: PolicyVersion) -> PolicyVersion | None:
    rows = (AuditLog.objects.filter(_SERVED, project_id=version.project_id)
            .exclude(target=f"policy_version:{version.id}").order_by("-at", "-id").values_list("after", flat=True))
    for after in rows:
        candidate = PolicyVersion.objects.filter(id=after["version_id"], state="retired").first()
        if candidate is not None:
            return candidate
    return None


_ACTIONS: dict[str, Callable[[PolicyVersion, Actor, str], None]] = {
    "approve": _approve, "reject": _reject, "rollback": _rollback,
}


# ---------------------------------------------------------------------------------- canary


def _canary_start(version: PolicyVersion, production: PolicyVersion, policy: GatePolicy, actor: Actor,
                  reason: str) -> None:
    rule = CanaryRule(confidence=policy.canary_confidence, min_events=policy.canary_min_events,
                      max_events=policy.canary_max_events)
    run = CanaryRun.objects.create(version=version, baseline=production, share=policy.canary_share,
                                   rule=asdict(rule))
    _transition(version, "canary", actor, "canary_start", reason, canary_share=run.share, baseline=production.number)
    _deploy_after_commit(version)


def _canary_close(version: PolicyVersion, outcome: str, verdict: CanaryVerdict | None) -> None:
    CanaryRun.objects.filter(version=version, decided_at__isnull=True).update(
        decided_at=timezone.now(), outcome=outcome, verdict=verdict.as_dict() if verdict else None)


def canary_counts(run: CanaryRun) -> tuple[ArmCounts, ArmCounts]:
    """Selector: live success/failure signals since the canary began, (canary, production)."""
    numbers = {run.version.number: "canary", run.baseline.number: "production"}
    rows = (FeedbackEvent.objects.filter(project_id=run.version.project_id, occurred_at__gte=run.started_at,
                                         trajectory__policy_version__in=list(numbers),
                                         signal__in=SUCCESS_SIGNALS + FAILURE_SIGNALS)
            .values("trajectory__policy_version", "signal").annotate(n=Count("id")))
    tally = {"canary": [0, 0], "production": [0, 0]}
    for row in rows:
        arm = tally[numbers[row["trajectory__policy_version"]]]
        arm[0 if row["signal"] in SUCCESS_SIGNALS else 1] += row["n"]
    return ArmCounts(*tally["canary"]), ArmCounts(*tally["production"])


def canary_decide(version_id: int, actor: Actor = "system:canary") -> CanaryVerdict:
    """Apply the stopping rule to a running canary: promote it fully, roll it back, or wait."""
    with transaction.atomic():
        version = _locked(version_id)
        run = (CanaryRun.objects.select_for_update().select_related("version", "baseline")
               .filter(version=version, decided_at__isnull=True).first())
        if version.state != "canary" or run is None:
            raise Conflict(f"policy v{version.number} is {version.state}, not in canary", "Nothing to decide.")
        verdict = sequential.canary_decide(*canary_counts(run), CanaryRule(**run.rule))
        if verdict.decision == "promote":
            _canary_close(version, "promote", verdict)
            _make_production(version, _production(version.project_id, lock=True), actor, "canary_promote", verdict.reason)
        elif verdict.decision == "rollback":
            _canary_close(version, "rollback", verdict)
            _transition(version, "rejected", actor, "canary_rollback", verdict.reason)
            _deploy_after_commit(version)
    return verdict


def canaries_decide_all() -> dict[int, str]:
    """Decide every running canary (the periodic task); {version id: decision}."""
    ids = CanaryRun.objects.filter(decided_at__isnull=True).values_list("version_id", flat=True)
    return {vid: canary_decide(vid).decision for vid in list(ids)}


# ---------------------------------------------------------------------------------- selectors


def version_list(project: Project, state: str | None = None) -> QuerySet[PolicyVersion]:
    qs = PolicyVersion.objects.filter(project=project).select_related("parent").prefetch_related(
        Prefetch("gate_reports", queryset=GateReport.objects.order_by("-created_at"), to_attr="reports"))
    return (qs.filter(state=state) if state else qs).order_by("-number")


def version_get(version_id: int, project: Project | None = None) -> PolicyVersion:
    qs = version_list(project) if project is not None else PolicyVersion.objects.select_related("parent").prefetch_related(
        Prefetch("gate_reports", queryset=GateReport.objects.order_by("-created_at"), to_attr="reports"))
    version = qs.filter(id=version_id).first()
    if version is None:
        raise NotFound(f"no policy version {version_id} in this project", "Check the id (GET /api/v1/versions).")
    return version


def latest_report(version: PolicyVersion) -> GateReport | None:
    reports = getattr(version, "reports", None)
    if reports is None:
        return version.gate_reports.order_by("-created_at").first()
    return reports[0] if reports else None


def version_lineage(project: Project) -> list[dict[str, Any]]:
    """Every version, oldest first, with its parent and whether and when it served."""
    served: dict[int, list[str]] = {}
    for target, at in AuditLog.objects.filter(project=project, after__state="production").values_list("target", "at"):
        served.setdefault(int(target.split(":")[1]), []).append(at.isoformat())
    return [
        {"id": v.id, "number": v.number, "parent": v.parent.number if v.parent else None, "state": v.state,
         "created_at": v.created_at.isoformat(), "production_since": served.get(v.id, [])}
        for v in PolicyVersion.objects.filter(project=project).select_related("parent").order_by("number")
    ]


def production_at(project: Project, when: datetime) -> PolicyVersion | None:
    """What was in production at `when`, from the append-only audit log."""
    row = (AuditLog.objects.filter(project=project, at__lte=when, after__state="production")
           .order_by("-at", "-id").values_list("after", flat=True).first())
    return PolicyVersion.objects.filter(id=row["version_id"]).first() if row else None


def audit_for_version(version: PolicyVersion) -> QuerySet[AuditLog]:
    return AuditLog.objects.filter(project_id=version.project_id, target=f"policy_version:{version.id}").order_by("at", "id")
