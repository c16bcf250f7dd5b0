"""Enqueueing Celery work by task name, through the transactional outbox (core/outbox.py).

Services enqueue by name rather than importing their app's `tasks` module, which imports the
services back (the cycle this breaks). The message is a row of the caller's transaction: the row
a task loads is visible when it runs, and a broker that is down when the transaction commits
delays the task (beat delivers it later) instead of dropping it.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from core.outbox import outbox_deliver, outbox_enqueue

OUTBOX_DELIVER = "core.tasks.outbox_deliver"


def enqueue_after_commit(task_name: str, *args: Any, **kwargs: Any) -> None:
    outbox_enqueue(task_name, *args, **kwargs)


@shared_task(name=OUTBOX_DELIVER, ignore_result=True)
def outbox_deliver_task() -> int:
    """Beat, every few seconds: sends the messages the broker could not take at commit time."""
    return outbox_deliver()
