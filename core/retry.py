"""The base class of every Celery task (webapp/celery.py `task_cls`): a task that meets a
database it cannot reach retries with exponential backoff (1 s, 2 s, 4 s … at most 5 min,
jittered) instead of failing, so the pipeline resumes by itself when PostgreSQL is back."""

from __future__ import annotations

from celery import Task
from django.db import InterfaceError, OperationalError


class StoreRetryTask(Task):
    autoretry_for = (OperationalError, InterfaceError)
    retry_backoff = 1
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 40
