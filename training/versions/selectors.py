"""Reads of policy versions: the one home for "which version is in production" and what a
project should serve (production plus an optional canary).

    .venv/bin/python -m pytest tests/training/promotion/test_promotion.py -q
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db.models import Prefetch, QuerySet

from core.errors import NotFound
from feedback.models import Project
from training.models import AuditLog, CanaryRun, Erasure, GateReport, PolicyVersion, VersionState


def policy_production(project: Project | int, *, lock: bool = False) -> PolicyVersion | None:
    """The version in production (the one most recently made so, should two rows ever say it)."""
    project_id = project if isinstance(project, int) else project.pk
    qs = PolicyVersion.objects.filter(project_id=project_id, state=VersionState.PRODUCTION)
    return (qs.select_for_update() if lock else qs).order_by("-updated_at", "-number").first()


def policy_get(project: Project, number: int | None) -> PolicyVersion | None:
    if number is None:
        return None
    return PolicyVersion.objects.filter(project=project, number=number).first()


def policy_by_number(project: Project, number: int) -> PolicyVersion:
    version = policy_get(project, number)
    if version is None:
        raise NotFound(f"there is no version v{number} in {project.slug}", "Pick a version in the registry.")
    return version


@dataclass(frozen=True)
class DeployTarget:
    """What a project should serve: production, and optionally a canary on a share of traffic."""

    project_id: int
    production: int | None  # version number
    canary: int | None = None
    canary_share: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def serving_target(project_id: int) -> DeployTarget:
    """Selector: the desired serving state of a project, from the PolicyVersion states."""
    prod = policy_production(project_id)
    canary = (CanaryRun.objects.filter(version__project_id=project_id, decided_at__isnull=True)
              .select_related("version").order_by("-started_at").first())
    return DeployTarget(
        project_id=project_id,
        production=prod.number if prod else None,
        canary=canary.version.number if canary else None,
        canary_share=canary.share if canary else 0.0,
    )



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
    for target, at in AuditLog.objects.filter(project=project, after__state=VersionState.PRODUCTION).values_list("target", "at"):
        served.setdefault(int(target.split(":")[1]), []).append(at.isoformat())
    return [
        {"id": v.id, "number": v.number, "parent": v.parent.number if v.parent else None, "state": v.state,
         "created_at": v.created_at.isoformat(), "production_since": served.get(v.id, [])}
        for v in PolicyVersion.objects.filter(project=project).select_related("parent").order_by("number")
    ]


def production_at(project: Project, when: datetime) -> PolicyVersion | None:
    """What was in production at `when`, from the append-only audit log."""
    row = (AuditLog.objects.filter(project=project, at__lte=when, after__state=VersionState.PRODUCTION)
           .order_by("-at", "-id").values_list("after", flat=True).first())
    return PolicyVersion.objects.filter(id=row["version_id"]).first() if row else None


def audit_for_version(version: PolicyVersion) -> QuerySet[AuditLog]:
    return AuditLog.objects.filter(project_id=version.project_id, target=f"policy_version:{version.id}").order_by("at", "id")


def versions_erased_from(project: Project | int, policy: str | None = None) -> set[int]:
    """Ids of the versions an erasure found had learned from erased data (under `policy`). Under
    "retrain" none of them serves again (training.promotion.services.erasure_retrain)."""
    erasures = Erasure.objects.filter(project=project)
    if policy is not None:
        erasures = erasures.filter(policy=policy)
    return {v for versions in erasures.values_list("versions", flat=True) for v in versions}
