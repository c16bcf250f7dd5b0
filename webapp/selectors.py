"""Reads for the dashboard pages."""

from __future__ import annotations

from django.db.models import Count

from feedback.models import Project


def project_overview() -> list[Project]:
    return list(
        Project.objects.annotate(
            n_trajectories=Count("trajectories", distinct=True),
        ).order_by("slug")
    )
