from django.contrib import admin, messages

from feedback.models import (
    ApiKey,
    FeedbackEvent,
    Project,
    Quarantine,
    Step,
    Trajectory,
    WebhookDelivery,
    WebhookSecret,
)
from feedback.services import webhook_secret_create


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "rate_limit_per_minute", "created_at")
    search_fields = ("slug", "name")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "project", "name", "owner", "scopes", "created_at", "revoked_at")
    list_filter = ("project",)
    raw_id_fields = ("owner",)

    def get_readonly_fields(self, request, obj=None):
        # Whom a key acts as is fixed when it is made (manage.py create_key --owner): rebinding
        # it would hand its decisions to someone else. Revoke it and create another instead.
        return ("key_hash", "prefix", "project", "owner") if obj is not None else ("key_hash", "prefix")


@admin.register(WebhookSecret)
class WebhookSecretAdmin(admin.ModelAdmin):
    """Neither the secret nor any part of it is ever shown: adding one generates it and shows it
    once, in the confirmation message."""

    list_display = ("__str__", "project", "created_at", "expires_at", "revoked_at")
    list_filter = ("project",)
    exclude = ("secret_encrypted",)

    def get_readonly_fields(self, request, obj=None):
        return ("project", "created_at") if obj is not None else ()

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        created = webhook_secret_create(obj.project)
        obj.pk = created.pk
        messages.warning(request, f"New webhook secret for {obj.project.slug}: {created.secret} "
                                  "(copy it now: it is not shown again).")


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("webhook_id", "project", "event_count", "received_at")
    list_filter = ("project",)


class StepInline(admin.TabularInline):
    model = Step
    extra = 0
    fields = ("index", "role", "content", "token_ids", "logprobs", "reward")


class FeedbackInline(admin.TabularInline):
    model = FeedbackEvent
    extra = 0
    fields = ("event_id", "signal", "value", "step", "occurred_at")


@admin.register(Trajectory)
class TrajectoryAdmin(admin.ModelAdmin):
    list_display = ("external_id", "project", "policy_version", "source", "task", "occurred_at")
    list_filter = ("project", "source", "task")
    search_fields = ("external_id",)
    inlines = [StepInline, FeedbackInline]


@admin.register(FeedbackEvent)
class FeedbackEventAdmin(admin.ModelAdmin):
    list_display = ("event_id", "project", "signal", "value", "trajectory_external_id", "trajectory", "occurred_at")
    list_filter = ("project", "signal")
    search_fields = ("event_id", "trajectory_external_id")
    raw_id_fields = ("trajectory",)


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
