"""HTTP API of promotion: list and read policy versions with their gate report; approve, reject
or roll back one. Thin views over training.promotion and training.versions.

Approve/reject/rollback accept any authenticated caller on purpose: the service decides, so a
refusal (403) is recorded in the audit log instead of stopping at a permission class; another
project's version is a 404 (nothing recorded), and refusals past a rate are 429s.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import BadRequest, Forbidden, refuse_repeated
from feedback.auth import HasAdminScope, HasReadScope, Principal
from feedback.selectors import project_for_member
from training.corpora.apis import caller_project
from training.models import PolicyVersion
from training.promotion.services import Action, candidate_promote
from training.schedule import training_config_get, training_config_set
from training.versions.selectors import latest_report, version_get, version_list


def _project_of(request):
    if isinstance(request.user, Principal):
        return request.user.project
    slug = request.GET.get("project")
    if not slug:
        raise BadRequest("which project?", "Pass ?project=<slug> when reading with a logged-in session.")
    # A project the account is no member of answers 404, like one that does not exist.
    return project_for_member(request.user, slug)[0]


class GateReportOutput(serializers.Serializer):
    id = serializers.IntegerField()
    passed = serializers.BooleanField()
    baseline = serializers.IntegerField(source="baseline.number", allow_null=True, default=None)
    checks = serializers.JSONField()
    policy = serializers.JSONField()
    created_at = serializers.DateTimeField()


class VersionOutput(serializers.Serializer):
    id = serializers.IntegerField()
    number = serializers.IntegerField()
    parent = serializers.IntegerField(source="parent.number", allow_null=True, default=None)
    state = serializers.CharField()
    manifest_hash = serializers.CharField()
    delta_bytes = serializers.IntegerField(allow_null=True)
    delta_ratio = serializers.FloatField(allow_null=True)  # of an adapter version: adapter bytes / base bytes
    adapter_base = serializers.IntegerField(source="adapter_base.number", allow_null=True, default=None)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    gate_report = serializers.SerializerMethodField()

    def get_gate_report(self, version: PolicyVersion) -> dict | None:
        report = latest_report(version)
        return GateReportOutput(report).data if report else None


class VersionListApi(APIView):
    """GET /api/v1/versions[?state=]: newest first, each with its latest gate report."""

    permission_classes = [HasReadScope]

    class FilterSerializer(serializers.Serializer):
        state = serializers.ChoiceField(choices=[s for s, _ in PolicyVersion.STATES], required=False)

    @extend_schema(parameters=[FilterSerializer], operation_id="v1_versions_list",
                   responses=inline_serializer("VersionList", {"results": VersionOutput(many=True)}))
    def get(self, request) -> Response:
        refuse_repeated(request.query_params, self.FilterSerializer().fields)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        versions = version_list(_project_of(request), **filters.validated_data)
        return Response({"results": VersionOutput(versions, many=True).data})


class VersionDetailApi(APIView):
    """GET /api/v1/versions/{id}: one version with its latest gate report."""

    permission_classes = [HasReadScope]

    @extend_schema(responses=VersionOutput)
    def get(self, request, version_id: int) -> Response:
        version = version_get(version_id, _project_of(request))
        return Response(VersionOutput(version).data)


# What approve/reject/rollback accept: a reason with a non-blank character (the audit log keeps
# it), at most 2,000 characters, no NUL (PostgreSQL text cannot hold it).
REASON_BODY = {
    "type": "object",
    "required": ["reason"],
    "properties": {"reason": {"type": "string", "minLength": 1, "maxLength": 2000, "pattern": "^[^\\x00]*[^\\s\\x00][^\\x00]*$",
                              "description": "Why, in a sentence: kept in the audit log."}},
}


class StrictCharField(serializers.CharField):
    """Takes only a string, as REASON_BODY says (DRF's CharField turns a number into its digits)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class _PromoteApi(APIView):
    action: Action
    permission_classes = [IsAuthenticated]

    class InputSerializer(serializers.Serializer):
        # Lenient on purpose: a missing reason is refused by candidate_promote *after* it has
        # recorded a refusal of who may not act; REASON_BODY documents what is accepted. Not
        # trimmed, so that the 2,000 characters are counted as sent, as REASON_BODY says.
        reason = StrictCharField(max_length=2000, allow_blank=True, required=False, default="", trim_whitespace=False)

    @extend_schema(request={"application/json": REASON_BODY}, responses=VersionOutput)
    def post(self, request, version_id: int) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        # The service answers 404 for a version of a project the caller is no member of (a key:
        # not its own project), before anything is recorded.
        version = candidate_promote(version_id, request.user, self.action, data.validated_data["reason"])
        return Response(VersionOutput(version_get(version.id)).data)


class VersionApproveApi(_PromoteApi):
    """POST /api/v1/versions/{id}/approve {"reason"}: to production (or canary when configured)."""

    action = "approve"


class VersionRejectApi(_PromoteApi):
    """POST /api/v1/versions/{id}/reject {"reason"}: a version awaiting approval or in canary."""

    action = "reject"


class VersionRollbackApi(_PromoteApi):
    """POST /api/v1/versions/{id}/rollback {"reason"}: end a canary, roll production back to the
    previous version, or bring an earlier production version back."""

    action = "rollback"


class TrainingConfigApi(APIView):
    """GET /api/v1/training-config: the project's training config (when runs start, what each is
    asked to do: steps, rl, group, adapter ...). PUT (admin): replaces it; a 400 lists every
    problem with its fix (a LoRA whose target_modules name no module of the policy lists those
    it has).

        curl -X PUT -H "Authorization: Bearer $ADMIN_KEY" -H 'Content-Type: application/json' \
             -d '{"min_new": 64, "adapter": {"kind": "lora", "rank": 8}}' http://localhost:8000/api/v1/training-config
    """

    permission_classes = [HasReadScope]
    parser_classes = [JSONParser]  # a config is JSON (nested objects a form cannot carry)

    @extend_schema(responses={200: inline_serializer("TrainingConfig", {"config": serializers.JSONField()})})
    def get(self, request) -> Response:
        schedule = training_config_get(_project_of(request))
        return Response({"config": {**schedule.to_dict(), "adapter": schedule.run.adapter.to_dict()}})

    @extend_schema(request=OpenApiTypes.OBJECT,  # the config itself: a Schedule's flat JSON (training/runs/settings.py)
                   responses={200: inline_serializer("TrainingConfigSet", {"config": serializers.JSONField()})})
    def put(self, request) -> Response:
        HasAdminScope().has_permission(request, self)  # a key without the admin scope: 403 with the fix
        project, _ = caller_project(request)
        if not isinstance(request.user, Principal) and project_for_member(request.user, project.slug)[1] != "admin":
            raise Forbidden(f"changing {project.slug!r}'s training config needs the admin role",
                            "Ask an admin of the project, or use an API key with scope 'admin'.")
        if not isinstance(request.data, dict):
            raise BadRequest("the body must be a JSON object",
                             'Send e.g. {"min_new": 64, "steps": 8, "adapter": {"kind": "lora", "rank": 8}}.')
        schedule = training_config_set(project, request.data)
        return Response({"config": {**schedule.to_dict(), "adapter": schedule.run.adapter.to_dict()}})
