"""The transactional outbox: a Celery message written as a row in the transaction that decides
it, delivered to the broker after the commit (and by beat, `core.tasks.outbox_deliver`, when the
broker was down then). A Redis outage delays work; it never drops it."""

from __future__ import annotations

from django.db import models


class OutboxMessage(models.Model):
    task = models.CharField(max_length=200)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["created_at"], condition=models.Q(sent_at__isnull=True),
                                name="outbox_pending")]

    def __str__(self) -> str:
        return f"{self.task}{tuple(self.args)} ({'sent' if self.sent_at else 'pending'})"
