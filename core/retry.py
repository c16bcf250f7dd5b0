"""The base class of every Celery task (webapp/celery.py `task_cls`): a task that meets a
database it cannot reach retries with exponential backoff (1 s, 2 s, 4 s … at most 5 min,
jittered) instead of failing, so the pipeline resumes by itself when PostgreSQL is back.

A task that beat sent (a periodic entry: it carries the `periodic_task_name` header) is not
retried: beat sends it again at its next tick, and retrying each tick's copy would pile up
delayed copies for as long as the outage lasts."""

from __future__ import annotations

import logging

from celery import Task
from celery.exceptions import Ignore
from django.db import InterfaceError, OperationalError

log = logging.getLogger(__name__)


class StoreRetryTask(Task):
    autoretry_for = (OperationalError, InterfaceError)
    retry_backoff = 1
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 40

    def retry(self, *args, exc: BaseException | None = None, **kwargs):
        entry = getattr(self.request, "periodic_task_name", None)
        if entry and isinstance(exc, self.autoretry_for):
            log.warning("%s (beat entry %r) left to the next tick: the database is unavailable (%s)",
                        self.name, entry, type(exc).__name__)
            raise Ignore()
        return super().retry(*args, exc=exc, **kwargs)
