"""The admin of rows that belong to one project: only that project's admins change them, and
every change writes an AuditLog row.

Django's model permissions are global (a staff account allowed to change reward specs could change
every project's), so each form here also asks for an admin Membership of the row's project (or a
superuser), in `has_change_permission`/`has_delete_permission` and again when saving (an add names
its project in the form, whose choices are the caller's admin projects). Credentials cannot be
escalated from a form: an API key's scopes, project and owner are fixed when it is made
(`manage.py create_key`), a revocation or an expiry is never undone or postponed, and a new webhook
secret is shown once on the page that answers its creation, never in a message (messages live
in a cookie). The feedback app's rows are registered here because their audit rows are the
training app's (imports only point down).

    .venv/bin/python -m pytest tests/training/test_project_admin.py -q
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import models
from django.template.response import TemplateResponse

from feedback.models import ApiKey, FeedbackEvent, Project, Quarantine, Step, Trajectory, WebhookSecret
from feedback.selectors import member_role, role_at_least
from feedback.services import webhook_secret_create
from training.models import AuditLog
from training.versions.services import actor_name

SECRET_FIELDS = {"secret_encrypted", "key_hash"}  # never copied into an audit row


def is_project_admin(user: Any, project_id: int | None) -> bool:
    if getattr(user, "is_superuser", False) and user.is_active:
        return True
    return project_id is not None and role_at_least(member_role(user, project_id), "admin")


def snapshot(obj: models.Model | None) -> dict[str, Any] | None:
    """The row's editable fields as JSON (secrets left out), for an audit row's before/after."""
    if obj is None:
        return None
    fields = {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields if f.name not in SECRET_FIELDS}
    return json.loads(json.dumps(fields, default=str))


class ProjectAdminRequired(admin.ModelAdmin):
    """Change, add and delete for the admins of the row's project only; each change audited."""

    @staticmethod
    def project_of(obj) -> int | None:
        return obj.project_id

    def has_change_permission(self, request, obj=None) -> bool:
        allowed = super().has_change_permission(request, obj)
        return allowed and (obj is None or is_project_admin(request.user, self.project_of(obj)))

    def has_delete_permission(self, request, obj=None) -> bool:
        allowed = super().has_delete_permission(request, obj)
        return allowed and (obj is None or is_project_admin(request.user, self.project_of(obj)))

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "project" and not request.user.is_superuser:
            kwargs["queryset"] = Project.objects.filter(memberships__user_id=request.user.pk,
                                                        memberships__role="admin")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def require_project_admin(self, request, project_id: int | None) -> None:
        if not is_project_admin(request.user, project_id):
            raise PermissionDenied("only an admin of the project (or a superuser) may change its rows: "
                                   "ask one, or to be made one")

    def save_model(self, request, obj, form, change) -> None:
        self.require_project_admin(request, self.project_of(obj))
        before = snapshot(type(obj).objects.filter(pk=obj.pk).first()) if change else None
        self.write(request, obj, form, change, before)
        self.audit(request, obj, "change" if change else "add", before, snapshot(obj))

    def write(self, request, obj, form, change, before: dict[str, Any] | None) -> None:
        super().save_model(request, obj, form, change)

    def delete_model(self, request, obj) -> None:
        self.require_project_admin(request, self.project_of(obj))
        before, pk = snapshot(obj), obj.pk
        super().delete_model(request, obj)
        obj.pk = pk
        self.audit(request, obj, "delete", before, None)

    def delete_queryset(self, request, queryset) -> None:
        for obj in queryset:
            self.delete_model(request, obj)

    def audit(self, request, obj, action: str, before, after) -> None:
        AuditLog.objects.create(project_id=self.project_of(obj), actor=actor_name(request.user),
                                action=f"admin_{action}", target=f"{obj._meta.model_name}:{obj.pk}"[:200],
                                before=before, after=after, reason="admin")


def _never_undone(obj: models.Model, field: str) -> None:
    """A revocation or expiry stays: it may be set, or moved earlier, never cleared or postponed
    (checked against the stored row, whatever the form held)."""
    old = type(obj).objects.filter(pk=obj.pk).values_list(field, flat=True).first()
    new = getattr(obj, field)
    if old is not None and (new is None or new > old):
        raise PermissionDenied(f"{field} of {obj} is {old}: a revocation or expiry is never undone or moved "
                               "later; make a new one instead (manage.py create_key, or add a webhook secret)")


@admin.register(ApiKey)
class ApiKeyAdmin(ProjectAdminRequired):
    """Keys are made by `manage.py create_key` (which shows the key once); here only a name
    changes and a key is revoked."""

    list_display = ("prefix", "project", "name", "owner", "scopes", "created_at", "revoked_at")
    list_filter = ("project",)

    def has_add_permission(self, request) -> bool:
        return False

    def get_readonly_fields(self, request, obj=None):
        # Whom a key acts as and what it may do are fixed when it is made: rebinding it would hand
        # its decisions to someone else, widening its scopes would grant what no one approved.
        fixed = ("key_hash", "prefix", "project", "owner", "scopes", "created_at")
        return (*fixed, "revoked_at") if obj is not None and obj.revoked_at is not None else fixed

    def write(self, request, obj, form, change, before) -> None:
        _never_undone(obj, "revoked_at")
        if before is not None and (obj.scopes != before["scopes"] or obj.owner_id != before["owner_id"]):
            raise PermissionDenied("an API key's scopes and owner are fixed: create another key instead")
        super().write(request, obj, form, change, before)


@admin.register(WebhookSecret)
class WebhookSecretAdmin(ProjectAdminRequired):
    """Neither the secret nor any part of it is ever shown, but once: adding one generates it and
    answers with a page that shows it (no message, no redirect, not cached)."""

    list_display = ("__str__", "project", "created_at", "expires_at", "revoked_at")
    list_filter = ("project",)
    exclude = ("secret_encrypted",)

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ("expires_at", "revoked_at")
        ended = tuple(f for f in ("expires_at", "revoked_at") if getattr(obj, f) is not None)
        return ("project", "created_at", *ended)

    def write(self, request, obj, form, change, before) -> None:
        if change:
            _never_undone(obj, "expires_at")
            _never_undone(obj, "revoked_at")
            super().write(request, obj, form, change, before)
            return
        created = webhook_secret_create(obj.project)
        obj.pk, obj.created_at = created.pk, created.created_at
        request.flywheel_new_secret = created.secret  # for response_add only: never stored

    def response_add(self, request, obj, post_url_continue=None):
        secret = getattr(request, "flywheel_new_secret", None)
        if secret is None:
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(request, "admin/feedback/webhooksecret/created.html", {
            **self.admin_site.each_context(request), "title": "New webhook secret", "secret": secret,
            "row": obj, "opts": self.opts})
        response["Cache-Control"] = "no-store"
        return response


class ReadOnlyInline(admin.TabularInline):
    """What was served and what was said about it: shown with its trajectory, changed only as a
    row of its own (audited)."""

    extra = 0

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class StepInline(ReadOnlyInline):
    model = Step
    fields = ("index", "role", "content", "token_ids", "logprobs", "reward")


class FeedbackInline(ReadOnlyInline):
    model = FeedbackEvent
    fields = ("event_id", "signal", "value", "step", "occurred_at")


@admin.register(Trajectory)
class TrajectoryAdmin(ProjectAdminRequired):
    list_display = ("external_id", "project", "policy_version", "source", "task", "occurred_at")
    list_filter = ("project", "source", "task")
    search_fields = ("external_id",)
    inlines = [StepInline, FeedbackInline]


@admin.register(FeedbackEvent)
class FeedbackEventAdmin(ProjectAdminRequired):
    list_display = ("event_id", "project", "signal", "value", "trajectory_external_id", "trajectory", "occurred_at")
    list_filter = ("project", "signal")
    search_fields = ("event_id", "trajectory_external_id")
    raw_id_fields = ("trajectory",)


@admin.register(Project)
class ProjectAdmin(ProjectAdminRequired):
    """A project's settings (its ingest rate) change by its admins; only a superuser adds one, and
    none is deleted here (its audit rows protect it)."""

    list_display = ("slug", "name", "rate_limit_per_minute", "created_at")
    search_fields = ("slug", "name")

    @staticmethod
    def project_of(obj) -> int | None:
        return obj.pk

    def has_add_permission(self, request) -> bool:
        return super().has_add_permission(request) and is_project_admin(request.user, None)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Quarantine)
class QuarantineAdmin(ProjectAdminRequired):
    """Items the queues set aside. Read-only; deleting a row (an admin of its project, audited)
    offers a reward item to its queue again."""

    list_display = ("project", "kind", "item", "failures", "last_at", "error")
    list_filter = ("project", "kind")
    search_fields = ("item", "error")
    raw_id_fields = ("trajectory",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
