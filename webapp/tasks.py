"""Celery tasks of the dashboard: the rollup refresh (every minute under beat, see migration 0002)."""

from __future__ import annotations

from celery import shared_task

from webapp.rollups import rollups_refresh as _rollups_refresh


@shared_task(name="webapp.tasks.rollups_refresh", ignore_result=True)
def rollups_refresh() -> dict[str, int]:
    return _rollups_refresh()
