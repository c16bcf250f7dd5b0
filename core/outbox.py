"""Hand-offs from the database to the broker that survive a broker outage.

`outbox_enqueue` writes the message as a row in the caller's transaction; once it commits, one
delivery is tried at once. A row that could not be delivered (Redis down, the process killed
between commit and send) stays pending and `outbox_deliver` (beat, every few seconds) sends it.
Delivery is at least once: a message is marked sent only after the broker took it, so a crash in
between sends it twice; every task it carries claims its work idempotently.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from core.models import OutboxMessage

log = logging.getLogger(__name__)

# Beat leaves a fresh row to the delivery its own commit triggers.
DELIVER_AFTER = timedelta(seconds=5)
KEEP_SENT = timedelta(days=1)


def outbox_enqueue(task_name: str, *args: Any, **kwargs: Any) -> OutboxMessage:
    message = OutboxMessage.objects.create(task=task_name, args=list(args), kwargs=kwargs)
    transaction.on_commit(lambda: outbox_send(message))
    return message


def _publish(message: OutboxMessage) -> None:
    # No publish retries here: a broker that is down is the outbox's job, not the request's. No
    # result either: nobody waits on it, and subscribing to it would retry a dead Redis for long.
    current_app.send_task(message.task, args=message.args, kwargs=message.kwargs, retry=False, ignore_result=True)


def outbox_send(message: OutboxMessage) -> bool:
    """Tries one delivery; never raises (it runs after a commit that was already acknowledged)."""
    try:
        _publish(message)
    except Exception as exc:  # noqa: BLE001 - any broker failure leaves the row for beat
        log.warning("outbox: %s not delivered now (%s); beat will retry", message, exc)
        _note_failure(message.pk, exc)
        return False
    try:
        OutboxMessage.objects.filter(pk=message.pk, sent_at__isnull=True).update(sent_at=timezone.now())
    except Exception:  # noqa: BLE001 - delivered; beat may deliver it once more (at least once)
        log.warning("outbox: %s delivered but not marked sent", message, exc_info=True)
    return True


def _note_failure(pk: int, exc: Exception) -> None:
    try:
        OutboxMessage.objects.filter(pk=pk).update(attempts=F("attempts") + 1,
                                                   last_error=f"{type(exc).__name__}: {exc}"[:2000])
    except Exception:  # noqa: BLE001 - the database may be down too; the row stays pending
        log.warning("outbox: could not record the failed delivery of %s", pk, exc_info=True)


def outbox_deliver(limit: int = 500, *, grace: timedelta = DELIVER_AFTER) -> int:
    """Sends pending messages older than `grace` (oldest first); returns how many went out.
    Rows are locked with SKIP LOCKED, so two deliverers never send the same batch at once."""
    sent = 0
    with transaction.atomic():
        pending = list(OutboxMessage.objects.select_for_update(skip_locked=True)
                       .filter(sent_at__isnull=True, created_at__lte=timezone.now() - grace)
                       .order_by("created_at")[:limit])
        for message in pending:
            try:
                _publish(message)
            except Exception as exc:  # noqa: BLE001 - the broker is still down: try the rest later
                log.warning("outbox: broker unavailable (%s); %d messages wait", exc, len(pending) - sent)
                OutboxMessage.objects.filter(pk=message.pk).update(
                    attempts=message.attempts + 1, last_error=f"{type(exc).__name__}: {exc}"[:2000])
                break
            OutboxMessage.objects.filter(pk=message.pk).update(sent_at=timezone.now(), attempts=message.attempts + 1)
            sent += 1
    OutboxMessage.objects.filter(sent_at__lt=timezone.now() - KEEP_SENT).delete()
    return sent
