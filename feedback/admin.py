"""The feedback app's admin. Keys, webhook secrets, trajectories and feedback events are
registered by training/project_admin.py: their changes are audited, and the audit log is the
training app's."""

from django.contrib import admin

from feedback.models import Project, Quarantine, WebhookDelivery


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "rate_limit_per_minute", "created_at")
    search_fields = ("slug", "name")


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("webhook_id", "project", "event_count", "received_at")
    list_filter = ("project",)


@admin.register(Quarantine)
class QuarantineAdmin(admin.ModelAdmin):
    """Items the queues set aside. Read-only; deleting a row offers a reward item to its queue again."""

    list_display = ("project", "kind", "item", "failures", "last_at", "error")
    list_filter = ("project", "kind")
    search_fields = ("item", "error")
    raw_id_fields = ("trajectory",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
