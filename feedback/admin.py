"""The feedback app's admin. Projects, keys, webhook secrets, trajectories, feedback events and
quarantined items are registered by training/project_admin.py: their changes are audited, and
the audit log is the training app's."""

from django.contrib import admin

from feedback.models import WebhookDelivery


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("webhook_id", "project", "event_count", "received_at")
    list_filter = ("project",)
