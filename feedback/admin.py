from django.contrib import admin

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


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "rate_limit_per_minute", "created_at")
    search_fields = ("slug", "name")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "project", "name", "scopes", "created_at", "revoked_at")
    list_filter = ("project",)
    readonly_fields = ("key_hash", "prefix")


@admin.register(WebhookSecret)
class WebhookSecretAdmin(admin.ModelAdmin):
    list_display = ("__str__", "project", "created_at", "expires_at", "revoked_at")
    list_filter = ("project",)
    exclude = ("secret",)


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
