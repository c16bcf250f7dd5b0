"""Enqueueing Celery work by task name, once the current transaction commits.

Services enqueue by name rather than importing their app's `tasks` module, which imports the
services back (the cycle this breaks). The row a task loads must be visible when it runs,
hence `on_commit`.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from django.db import transaction


def enqueue_after_commit(task_name: str, *args: Any, **kwargs: Any) -> None:
    transaction.on_commit(lambda: current_app.send_task(task_name, args=args, kwargs=kwargs))
