"""Reads of serving replicas: which are live (a fresh heartbeat, not stopped), and the registry's
view of each (address, versions, heartbeat age).

    .venv/bin/python -m pytest tests/training/replicas/test_replicas.py -q
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from feedback.models import Project
from training.models import ReplicaState, ServingReplica


def replica_stale_before(now: datetime | None = None) -> datetime:
    return (now or timezone.now()) - timedelta(seconds=settings.FLYWHEEL_REPLICA_STALE_S)


def replicas_live(project_id: int) -> QuerySet[ServingReplica]:
    """Replicas a push goes to: not stopped, heartbeat fresher than FLYWHEEL_REPLICA_STALE_S."""
    return (ServingReplica.objects.filter(project_id=project_id, heartbeat_at__gte=replica_stale_before())
            .exclude(state=ReplicaState.STOPPED).order_by("address"))


def replicas_registered(project_id: int) -> bool:
    """Whether any serving process of the project ever registered (then pushes go to replicas)."""
    return ServingReplica.objects.filter(project_id=project_id).exists()


def replica_rows(project: Project) -> list[dict[str, Any]]:
    """Every replica of the project, live ones first: address, versions, heartbeat age, status."""
    now, cutoff = timezone.now(), replica_stale_before()
    rows = []
    for r in ServingReplica.objects.filter(project=project).order_by("-heartbeat_at")[:200]:
        live = r.state != ReplicaState.STOPPED and r.heartbeat_at >= cutoff
        rows.append({"r": r, "live": live, "status": "live" if live else ("stopped" if r.state == ReplicaState.STOPPED else "down"),
                     "age_s": max((now - r.heartbeat_at).total_seconds(), 0.0)})
    return sorted(rows, key=lambda row: not row["live"])


def replicas_probe_refused() -> list[tuple[str, str, int | None]]:
    """(project slug, address, version refused) of every live replica whose last probe refused a
    swap: the web app's alert metric (flywheel_replica_probe_failed)."""
    rows = (ServingReplica.objects.filter(heartbeat_at__gte=replica_stale_before(), probe__ok=False)
            .exclude(state=ReplicaState.STOPPED).values_list("project__slug", "address", "probe"))
    return [(slug, address, probe.get("version")) for slug, address, probe in rows]
