"""Writes of promotion: approve, reject, roll back, the canary and its stopping rule, the base
policy's install and the gate policy's versions.

    .venv/bin/python -m pytest tests/training/promotion/test_promotion.py tests/training/promotion/test_promotion_api.py -q
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Literal

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from redis.exceptions import RedisError

from core.cache import count
from core.errors import BadRequest, Conflict, Forbidden, NotFound, RateLimited
from feedback.auth import Principal
from feedback.models import Project
from feedback.selectors import member_role, principal_role, principal_user, role_at_least
from feedback.services import membership_set
from training.gate.config import GateThresholds
from training.models import AuditLog, CanaryRun, GatePolicy, PolicyVersion, TrainingRun, VersionState
from training.promotion import sequential
from training.promotion.deploy import deploy_hook
from training.promotion.selectors import POLICY_FIELDS, canary_counts, gate_policy_active, gate_policy_json
from training.promotion.sequential import CanaryRule, CanaryVerdict
from training.versions.selectors import policy_production, versions_erased_from
from training.versions.services import (
    Actor,
    actor_name,
    version_audit,
    version_checkpoint_refuse,
    version_checkpoint_verify,
    version_locked,
    version_snapshot,
    version_transition,
)

log = logging.getLogger(__name__)

Action = Literal["approve", "reject", "rollback"]


def base_policy_install(version: PolicyVersion, actor: Actor, reason: str) -> PolicyVersion:
    """Put a base policy (one not produced by a training run, e.g. bootstrap_policy's) straight
    into production, retiring the current one; audited like every other state change."""
    with transaction.atomic():
        version = version_locked(version.id)
        current = policy_production(version.project_id, lock=True)
        if current is not None and current.id != version.id:
            version_transition(current, VersionState.RETIRED, actor, "retire", reason)
        version_transition(version, VersionState.PRODUCTION, actor, "install_base", reason)
        _deploy_after_commit(version)
    return version


def _deploy_after_commit(version: PolicyVersion) -> None:
    transaction.on_commit(lambda: deploy_hook(version))


def gate_policy_update(project: Project, actor: Actor, reason: str = "", **fields: Any) -> GatePolicy:
    """A new version of the project's gate policy: the active one with `fields` changed."""
    with transaction.atomic():
        Project.objects.select_for_update().get(id=project.id)  # serialises version numbers
        current = gate_policy_active(project)
        new = GatePolicy(project=project, version=current.version + 1,
                         **{f: getattr(current, f) for f in POLICY_FIELDS}, note=reason)
        for name, value in fields.items():
            if name not in POLICY_FIELDS:
                raise BadRequest(f"unknown gate policy field {name!r}", f"Use one of {sorted(POLICY_FIELDS)}.")
            setattr(new, name, value)
        new.created_by = actor if isinstance(actor, AbstractBaseUser) else None
        _validate_policy(new)
        new.save()
        AuditLog.objects.create(project=project, actor=actor_name(actor), action="gate_policy_update",
                                target=f"gate_policy:{new.version}", before=gate_policy_json(current),
                                after=gate_policy_json(new), reason=reason)
    return new


def _validate_policy(policy: GatePolicy) -> None:
    try:
        GateThresholds.from_json(policy.thresholds)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"invalid gate thresholds: {exc}", "Fix or drop the named keys.") from exc
    if not 0 <= policy.canary_share < 1:
        raise BadRequest(f"canary_share {policy.canary_share} is outside [0, 1)", "Use 0 for no canary, e.g. 0.1 for 10%.")


def _sees(actor: Actor, project_id: int) -> bool:
    """Whether the project's versions exist for `actor` at all (else: 404, nothing recorded)."""
    if isinstance(actor, str):
        return True  # a system actor (its decisions are refused below, on record)
    if isinstance(actor, Principal):
        return actor.project.id == project_id  # a key sees its own project only
    return principal_role(actor, project_id) is not None


def _may_decide(actor: Actor, project_id: int) -> tuple[str, str] | None:
    """None when `actor` may approve, reject and roll back the project's versions; else what is
    missing and how to get it. A key decides as its owner, and only with the 'admin' scope."""
    if isinstance(actor, str):
        return f"{actor} may not decide on policy versions", "Decisions are made by an approver of the project."
    if isinstance(actor, Principal):
        if "admin" not in actor.scopes:
            return (f"{actor_name(actor)} lacks the 'admin' scope",
                    "Use a key with scope 'admin' bound to an approver (manage.py create_key --scopes admin --owner U).")
        if actor.owner is None:
            return (f"{actor_name(actor)} is bound to no person or service account, so it decides nothing",
                    "Create a key bound to an approver of the project (manage.py create_key --owner USERNAME).")
    if not role_at_least(principal_role(actor, project_id), "approver"):
        return (f"{actor_name(actor)} is not an approver of this project",
                "Ask the project's admin for the approver role (or let an approver decide).")
    return None


def _refuse(version: PolicyVersion, actor: Actor, action: str, message: str, fix: str, reason: str) -> Forbidden:
    refusal_rate_check(actor)
    # Recorded in its own transaction: the refusal must stay on record although the request fails.
    with transaction.atomic():
        version_audit(version, actor, f"{action}_refused", version_snapshot(version), reason, refused=message)
    return Forbidden(message, fix)


def _refusal_counter(actor: Actor) -> str:
    user = principal_user(actor)
    if user is not None:
        return f"user:{user.pk}"
    if isinstance(actor, Principal):
        return f"key:{actor.key_id}:{actor.project.id}:{actor.name}"
    return f"actor:{actor_name(actor)}"


def refusal_rate_check(actor: Actor) -> None:
    """At most FLYWHEEL_REFUSALS_MAX refused decisions per principal per FLYWHEEL_REFUSAL_WINDOW_S
    (a fixed window counted in Redis) are written to the audit log; past that the caller gets
    429 with Retry-After and nothing is written. Redis unreachable: the row is written (logged)."""
    window_s = max(1, int(settings.FLYWHEEL_REFUSAL_WINDOW_S))
    window = int(time.time() // window_s)
    key = f"promotion-refusals:{_refusal_counter(actor)}:{window}"
    try:
        used = count(key, 1, window_s * 2)
    except (RedisError, OSError):
        log.warning("refusal limit not applied to %s: Redis is unreachable", actor_name(actor), exc_info=True)
        return
    if used > settings.FLYWHEEL_REFUSALS_MAX:
        retry = window_s - int(time.time() % window_s)
        raise RateLimited(
            f"too many refused decisions from {actor_name(actor)}: more than {settings.FLYWHEEL_REFUSALS_MAX} "
            f"in {window_s} s (they were refused and recorded; this one was not)",
            f"Retry after {retry} s, as an approver of the project (the earlier refusals say what was missing).",
            headers={"Retry-After": str(retry)},
        )


def candidate_promote(version: PolicyVersion | int, actor: Actor, action: Action, reason: str) -> PolicyVersion:
    """approve | reject | rollback a version, as `actor`, for `reason` (required)."""
    version_id = version if isinstance(version, int) else version.id
    current = PolicyVersion.objects.filter(id=version_id).first()
    if current is None:
        raise NotFound(f"no policy version {version_id}", "Check the id (GET /api/v1/versions lists them).")
    if not _sees(actor, current.project_id):  # another project's version: as if it did not exist
        raise NotFound(f"no policy version {version_id}", "Check the id (GET /api/v1/versions lists them).")
    if action not in _ACTIONS:
        raise BadRequest(f"unknown action {action!r}", "Use approve, reject or rollback.")
    refused = _may_decide(actor, current.project_id)
    if refused is not None:
        raise _refuse(current, actor, action, f"{refused[0]}: it may not {action} policy versions", refused[1],
                      reason or "")
    if not (reason or "").strip():
        raise BadRequest("a reason is required", "Say in a sentence why (it is kept in the audit log).")
    if action == "approve":
        _two_person_check(current, actor, reason)
        _checkpoint_check(current)
    with transaction.atomic():
        locked = version_locked(version_id)
        _ACTIONS[action](locked, actor, reason.strip())
    return PolicyVersion.objects.get(id=version_id)


def _checkpoint_check(version: PolicyVersion) -> None:
    """A version whose checkpoint does not read back whole never reaches production: it is marked
    failed (rejected, audited) and the approval refused; production keeps serving."""
    problem = version_checkpoint_verify(version)
    if problem is None:
        return
    version_checkpoint_refuse(version.id, "system:checkpoint", problem)
    production = policy_production(version.project_id)
    serving = f"v{production.number} stays in production" if production else "nothing was put in production"
    raise Conflict(f"{problem}; v{version.number} was marked rejected and {serving}",
                   "Train a new candidate (the store lost or altered this one's bytes: check the disk under "
                   "FLYWHEEL_CHECKPOINT_DIR).")


def _two_person_check(version: PolicyVersion, actor: Actor, reason: str) -> None:
    """With the project's two-person rule on, whoever started the run that trained `version`
    (a person or service account, directly or through a key bound to them) cannot approve it;
    a version whose starter is not on record cannot be approved at all."""
    if not gate_policy_active(version.project).two_person_rule:
        return
    run = TrainingRun.objects.filter(candidate=version).select_related("started_by").order_by("-created_at").first()
    if run is None or run.started_by_id is None:
        raise _refuse(version, actor, "approve",
                      f"v{version.number} has no recorded starter, so the two-person rule cannot be checked",
                      "Train the candidate through a run (the beat and train_now record who started it), or turn "
                      "the project's two-person rule off in its gate policy.", reason)
    approver = principal_user(actor)
    if approver is not None and approver.pk == run.started_by_id:
        via = " (through a key bound to them)" if isinstance(actor, Principal) else ""
        raise _refuse(version, actor, "approve",
                      f"{approver.get_username()}{via} started run {run.pk}, which trained v{version.number}",
                      "The two-person rule is on: another approver of the project must approve it.", reason)


def membership_grant(project: Project, user: AbstractBaseUser, role: str | None, actor: Actor,
                     reason: str = "") -> str | None:
    """Gives `user` `role` in `project` (None: removes them), audited; `actor` must be an admin
    of the project, a superuser, or a system actor (the command line). Returns the role before."""
    if not isinstance(actor, str) and not (getattr(actor, "is_superuser", False) and actor.is_active) \
            and not role_at_least(member_role(principal_user(actor), project.id), "admin"):
        raise Forbidden(f"{actor_name(actor)} may not change the members of {project.slug}",
                        "Ask an admin of the project (or a superuser) to do it.")
    with transaction.atomic():
        before = membership_set(project, user, role)
        if before != role:
            AuditLog.objects.create(project=project, actor=actor_name(actor),
                                    action="membership_revoke" if role is None else "membership_grant",
                                    target=f"user:{user.get_username()}"[:200], before={"role": before},
                                    after={"role": role}, reason=reason)
    return before


def _approve(version: PolicyVersion, actor: Actor, reason: str) -> None:
    if version.state != VersionState.AWAITING_APPROVAL:
        raise Conflict(f"policy v{version.number} is {version.state}, not awaiting approval",
                       "Only a version that passed the gate can be approved.")
    _never_erased(version)
    policy = gate_policy_active(version.project)
    production = policy_production(version.project_id, lock=True)
    if production is not None and policy.canary_share > 0:
        _canary_start(version, production, policy, actor, reason)
    else:
        _make_production(version, production, actor, "approve", reason)


def _make_production(version: PolicyVersion, previous: PolicyVersion | None, actor: Actor, action: str,
                     reason: str) -> None:
    if previous is not None and previous.id != version.id:
        version_transition(previous, VersionState.RETIRED, actor, "retire", reason, replaced_by=version.number)
    version_transition(version, VersionState.PRODUCTION, actor, action, reason)
    _deploy_after_commit(version)


def _reject(version: PolicyVersion, actor: Actor, reason: str) -> None:
    if version.state == VersionState.CANARY:
        _canary_close(version, "rollback", None)
    elif version.state != VersionState.AWAITING_APPROVAL:
        raise Conflict(f"policy v{version.number} is {version.state}; only a version awaiting approval or in "
                       "canary can be rejected", "To take a production version out, roll back to an earlier one.")
    version_transition(version, VersionState.REJECTED, actor, "reject", reason)
    _deploy_after_commit(version)


def _rollback(version: PolicyVersion, actor: Actor, reason: str) -> None:
    """On a canary: end it. On production: go back to the previous production version. On a
    retired version that was in production: make it production again."""
    if version.state == VersionState.CANARY:
        _canary_close(version, "rollback", None)
        version_transition(version, VersionState.REJECTED, actor, "rollback", reason)
        _deploy_after_commit(version)
        return
    current = policy_production(version.project_id, lock=True)
    if version.state == VersionState.PRODUCTION:
        target = _previous_production(version)
        if target is None:
            raise Conflict(f"policy v{version.number} is the first production version", "There is nothing to roll back to.")
    elif version.state == VersionState.RETIRED and _was_production(version):
        _never_erased(version)
        target = version
    else:
        raise Conflict(f"policy v{version.number} ({version.state}) was never in production",
                       "Roll back to a version that served before (see GET /api/v1/versions?state=retired).")
    target = PolicyVersion.objects.select_for_update().get(id=target.id)
    _make_production(target, current, actor, "rollback", reason)


_SERVED = Q(after__state=VersionState.PRODUCTION) | Q(before__state=VersionState.PRODUCTION)


def _was_production(version: PolicyVersion) -> bool:
    return AuditLog.objects.filter(_SERVED, target=f"policy_version:{version.id}").exists()


def _previous_production(version: PolicyVersion) -> PolicyVersion | None:
    """The version that served before `version` and may serve again (not one that learned from
    data erased under the retrain policy)."""
    erased = versions_erased_from(version.project_id, policy="retrain")
    rows = (AuditLog.objects.filter(_SERVED, project_id=version.project_id)
            .exclude(target=f"policy_version:{version.id}").order_by("-at", "-id").values_list("after", flat=True))
    for after in rows:
        candidate = PolicyVersion.objects.filter(id=after["version_id"], state=VersionState.RETIRED).first()
        if candidate is not None and candidate.id not in erased:
            return candidate
    return None


def _never_erased(version: PolicyVersion) -> None:
    if version.id in versions_erased_from(version.project_id, policy="retrain"):
        raise Conflict(f"policy v{version.number} learned from data erased under the project's retrain policy; "
                       "it does not serve again",
                       "Roll back to a version that never saw the data, or let the loop train a new candidate "
                       "(the project's Data page lists each erasure and the versions it found).")


def erasure_retrain(project: Project, tainted: set[int], actor: Actor, reason: str) -> dict[str, Any]:
    """The retrain erasure policy applied to the versions that learned from erased data
    (`tainted`): none of them serves or waits to. A tainted production is retired and the newest
    version that served before and never saw the data serves again (deployed after commit); a
    tainted canary, or a tainted version awaiting approval, gated or a candidate, is rejected.
    The next run continues from the newest clean version (training.runs.selectors.training_head):
    the loop learns again without the data. Every move is an audited version_transition, in the
    caller's transaction. Returns {"production": the number now serving, "production_clean": whether
    it never saw erased data (false only when no clean version ever served), "retired": [...],
    "rejected": [...]}."""
    out: dict[str, Any] = {"production": None, "production_clean": True, "retired": [], "rejected": []}
    production = policy_production(project.pk, lock=True)
    if production is not None and production.id in tainted:
        target = _newest_clean_served(project, tainted)
        if target is not None:  # else nothing clean ever served: production stays, and the answer says so
            _make_production(target, production, actor, "erasure_rollback", reason)
            out["retired"].append(production.number)
            production = target
    out["production"] = production.number if production is not None else None
    out["production_clean"] = production is None or production.id not in tainted
    waiting = (PolicyVersion.objects.select_for_update().filter(
        project=project, id__in=tainted, state__in=(VersionState.CANARY, VersionState.AWAITING_APPROVAL,
                                                    VersionState.GATED, VersionState.CANDIDATE)).order_by("number"))
    for version in waiting:
        was_canary = version.state == VersionState.CANARY
        if was_canary:
            _canary_close(version, "rollback", None)
        version_transition(version, VersionState.REJECTED, actor, "erasure_reject", reason)
        if was_canary:  # the replicas stop serving its share
            _deploy_after_commit(version)
        out["rejected"].append(version.number)
    return out


def _newest_clean_served(project: Project, tainted: set[int]) -> PolicyVersion | None:
    retired = (PolicyVersion.objects.select_for_update().filter(project=project, state=VersionState.RETIRED)
               .exclude(id__in=tainted).order_by("-number"))
    return next((v for v in retired if _was_production(v)), None)


_ACTIONS: dict[str, Callable[[PolicyVersion, Actor, str], None]] = {
    "approve": _approve, "reject": _reject, "rollback": _rollback,
}


def _canary_start(version: PolicyVersion, production: PolicyVersion, policy: GatePolicy, actor: Actor,
                  reason: str) -> None:
    rule = CanaryRule(confidence=policy.canary_confidence, min_events=policy.canary_min_events,
                      max_events=policy.canary_max_events)
    run = CanaryRun.objects.create(version=version, baseline=production, share=policy.canary_share,
                                   rule=asdict(rule))
    version_transition(version, VersionState.CANARY, actor, "canary_start", reason, canary_share=run.share, baseline=production.number)
    _deploy_after_commit(version)


def _canary_close(version: PolicyVersion, outcome: str, verdict: CanaryVerdict | None) -> None:
    CanaryRun.objects.filter(version=version, decided_at__isnull=True).update(
        decided_at=timezone.now(), outcome=outcome, verdict=verdict.as_dict() if verdict else None)


def canary_decide(version_id: int, actor: Actor = "system:canary") -> CanaryVerdict:
    """Apply the stopping rule to a running canary: promote it fully, roll it back, or wait."""
    with transaction.atomic():
        version = version_locked(version_id)
        run = (CanaryRun.objects.select_for_update().select_related("version", "baseline")
               .filter(version=version, decided_at__isnull=True).first())
        if version.state != VersionState.CANARY or run is None:
            raise Conflict(f"policy v{version.number} is {version.state}, not in canary", "Nothing to decide.")
        verdict = sequential.canary_decide(*canary_counts(run), CanaryRule(**run.rule))
        if verdict.decision == "promote":
            _canary_close(version, "promote", verdict)
            _make_production(version, policy_production(version.project_id, lock=True), actor, "canary_promote", verdict.reason)
        elif verdict.decision == "rollback":
            _canary_close(version, "rollback", verdict)
            version_transition(version, VersionState.REJECTED, actor, "canary_rollback", verdict.reason)
            _deploy_after_commit(version)
    return verdict


def canaries_decide_all() -> dict[int, str]:
    """Decide every running canary (the periodic task); {version id: decision}."""
    ids = CanaryRun.objects.filter(decided_at__isnull=True).values_list("version_id", flat=True)
    return {vid: canary_decide(vid).decision for vid in list(ids)}
