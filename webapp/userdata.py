"""The dashboard's reads of users' data: the Data page and the lineage panels of the replay and
registry pages (thin over feedback.userdata and training.lineage)."""

from __future__ import annotations

from typing import Any

from feedback.models import Project, RedactionTally, Trajectory
from feedback.userdata.selectors import data_overview
from training.lineage.selectors import Learned, lineage_of
from training.models import Erasure, RunLineage
from training.versions.selectors import versions_erased_from


def data_page(project: Project) -> dict[str, Any]:
    return {
        "overview": data_overview(project),
        "redactions": list(RedactionTally.objects.filter(project=project).order_by("redactor")
                           .values_list("redactor", "count")),
        "erasures": list(Erasure.objects.filter(project=project).order_by("-created_at")[:50]),
        "erasures_total": Erasure.objects.filter(project=project).count(),
    }


def registry_lineage(project: Project) -> dict[str, Any]:
    """Per run: how many trajectories and feedback events it trained on; the versions an erasure
    found had learned from erased data (flagged)."""
    lineages = (RunLineage.objects.filter(project=project).select_related("run__candidate")
                .order_by("-run_id")[:200])
    return {"runs": [{"run": lin.run_id, "version": lin.run.candidate.number if lin.run.candidate else None,
                      "trajectories": lin.trajectory_count, "feedback": lin.feedback_count} for lin in lineages],
            "erased_from": versions_erased_from(project)}


def replay_lineage(project: Project, trajectory: Trajectory) -> list[Learned]:
    return lineage_of(project, trajectory=trajectory.external_id)
