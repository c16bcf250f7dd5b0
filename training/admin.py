from django.contrib import admin

from training.models import (
    AuditLog,
    GateReport,
    PolicyVersion,
    Reward,
    RewardSpec,
    RubricScore,
    TrainingRun,
    TrainingStep,
)


@admin.register(RewardSpec)
class RewardSpecAdmin(admin.ModelAdmin):
    list_display = ("project", "version", "settle_seconds", "created_at")
    list_filter = ("project",)


@admin.register(Reward)
class RewardAdmin(admin.ModelAdmin):
    list_display = ("trajectory", "spec", "total", "computed_at")
    raw_id_fields = ("trajectory",)


@admin.register(RubricScore)
class RubricScoreAdmin(admin.ModelAdmin):
    list_display = ("trajectory", "aspect", "score", "judge", "error")
    raw_id_fields = ("trajectory",)


@admin.register(PolicyVersion)
class PolicyVersionAdmin(admin.ModelAdmin):
    list_display = ("project", "number", "state", "parent", "delta_ratio", "created_at")
    list_filter = ("project", "state")


class TrainingStepInline(admin.TabularInline):
    model = TrainingStep
    extra = 0


@admin.register(TrainingRun)
class TrainingRunAdmin(admin.ModelAdmin):
    list_display = ("id", "project", "base_version", "candidate", "state", "progress", "created_at")
    list_filter = ("project", "state")
    inlines = [TrainingStepInline]


@admin.register(GateReport)
class GateReportAdmin(admin.ModelAdmin):
    list_display = ("version", "baseline", "passed", "created_at")


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = ("at", "project", "actor", "action", "target", "reason")
    list_filter = ("project", "action")

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
