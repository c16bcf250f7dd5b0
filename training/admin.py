from django.contrib import admin
from django.core.exceptions import PermissionDenied

from core.errors import ApplicationError
from feedback.models import Membership
from feedback.selectors import member_role, role_at_least
from training.models import (
    AuditLog,
    CanaryRun,
    EvalSuite,
    GatePolicy,
    GateReport,
    PolicyVersion,
    Reward,
    RewardSpec,
    RubricScore,
    TrainingRun,
    TrainingStep,
)
from training.project_admin import ProjectAdminRequired, ReadOnlyInline
from training.promotion.services import gate_policy_update, membership_grant
from training.rewards.services import SPEC_FIELDS, reward_spec_update


@admin.register(RewardSpec)
class RewardSpecAdmin(ProjectAdminRequired):
    """Edits go through reward_spec_update: a spec that rewards used becomes a new version. Only
    the project's admins edit it, audited (ProjectAdminRequired)."""

    list_display = ("project", "version", "settle_seconds", "created_at")
    list_filter = ("project",)
    readonly_fields = ("version",)

    def write(self, request, obj, form, change, before) -> None:
        if not change:
            super().write(request, obj, form, change, before)
            return
        saved = reward_spec_update(obj.project, **{f: getattr(obj, f) for f in SPEC_FIELDS})
        if saved.pk != obj.pk:
            self.message_user(request, f"v{obj.version} is used by rewards, so the edit was saved as v{saved.version}.")
        obj.pk, obj.version = saved.pk, saved.version


@admin.register(Reward)
class RewardAdmin(admin.ModelAdmin):
    list_display = ("trajectory", "spec", "total", "computed_at")
    raw_id_fields = ("trajectory",)


@admin.register(RubricScore)
class RubricScoreAdmin(admin.ModelAdmin):
    list_display = ("trajectory", "aspect", "score", "judge", "error")
    raw_id_fields = ("trajectory",)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown, never written: no add, change or delete for anyone, superusers included. These rows
    change only through their services (a version's state through
    training.versions.services.version_transition, audited in the same transaction)."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(PolicyVersion)
class PolicyVersionAdmin(ReadOnlyAdmin):
    """State changes go through the promotion service (approve, reject, roll back from the
    dashboard or the API): gate, approval, audit row and deploy, never a form field."""

    list_display = ("project", "number", "state", "parent", "delta_ratio", "created_at")
    list_filter = ("project", "state")


class TrainingStepInline(ReadOnlyInline):
    model = TrainingStep


@admin.register(TrainingRun)
class TrainingRunAdmin(ReadOnlyAdmin):
    """Read-only: `started_by` is what the two-person rule checks, `candidate` what it checks it for."""

    list_display = ("id", "project", "base_version", "candidate", "state", "started_by", "progress", "created_at")
    list_filter = ("project", "state")
    inlines = [TrainingStepInline]


@admin.register(GateReport)
class GateReportAdmin(ReadOnlyAdmin):
    list_display = ("version", "baseline", "passed", "created_at")


@admin.register(AuditLog)
class AuditLogAdmin(ReadOnlyAdmin):
    """Append-only, and only the services append: no row is added, edited or deleted here."""

    list_display = ("at", "project", "actor", "action", "target", "reason")
    list_filter = ("project", "action")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    """Who sees and decides for which project. Saving or deleting goes through
    training.promotion.services.membership_grant: audited, and only by a superuser or an admin
    of the project."""

    list_display = ("project", "user", "role", "created_at")
    list_filter = ("project", "role")
    raw_id_fields = ("user",)

    def get_readonly_fields(self, request, obj=None):
        return ("project", "user") if obj is not None else ()

    def save_model(self, request, obj, form, change) -> None:
        self._grant(request, obj, obj.role)
        obj.pk = Membership.objects.get(project=obj.project, user=obj.user).pk

    def delete_model(self, request, obj) -> None:
        self._grant(request, obj, None)

    @staticmethod
    def _grant(request, obj, role) -> None:
        try:
            membership_grant(obj.project, obj.user, role, request.user, reason="admin")
        except ApplicationError as exc:
            raise PermissionDenied(f"{exc.message}. {exc.fix}") from exc

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset.select_related("project", "user"):
            self.delete_model(request, obj)


# --- gated promotion ---------------------------------------------------------------------------



@admin.register(GatePolicy)
class GatePolicyAdmin(admin.ModelAdmin):
    """Saving an edited policy stores a new version; the old one stays as GateReports cite it."""

    list_display = ("project", "version", "two_person_rule", "canary_share", "created_by", "created_at")
    list_filter = ("project",)
    readonly_fields = ("version", "created_by", "created_at")

    def save_model(self, request, obj, form, change) -> None:
        # The gate policy holds the two-person rule: only a superuser or an admin of the project
        # changes it (model permissions alone are global).
        if not request.user.is_superuser and not role_at_least(member_role(request.user, obj.project_id), "admin"):
            raise PermissionDenied(f"only an admin of {obj.project.slug} (or a superuser) may change its gate policy")
        fields = {f: getattr(obj, f) for f in ("thresholds", "two_person_rule", "canary_share",
                                               "canary_min_events", "canary_max_events", "canary_confidence")}
        new = gate_policy_update(obj.project, request.user, reason=obj.note, **fields)
        obj.pk, obj.version = new.pk, new.version

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(EvalSuite)
class EvalSuiteAdmin(ProjectAdminRequired):
    """Saving an edited suite stores a new version (a report names the suite version it used).
    Only the project's admins edit it, audited (ProjectAdminRequired)."""

    list_display = ("project", "name", "version", "n_samples", "max_tokens", "created_at")
    list_filter = ("project", "name")
    readonly_fields = ("version", "created_at")

    def write(self, request, obj, form, change, before) -> None:
        from django.db.models import Max

        latest = EvalSuite.objects.filter(project=obj.project, name=obj.name).aggregate(v=Max("version"))["v"]
        obj.pk, obj.version = None, (latest or 0) + 1
        obj._state.adding = True
        super().write(request, obj, form, change, before)


@admin.register(CanaryRun)
class CanaryRunAdmin(ReadOnlyAdmin):
    list_display = ("version", "baseline", "share", "started_at", "decided_at", "outcome")
