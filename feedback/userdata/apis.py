"""HTTP API of users' data (admin scope): the data policy, the opt-out list and a user's subject
access export (JSON Lines). Erasures and lineage are training's (training/lineage/apis.py).

A key needs the `admin` scope; a signed-in person must be an admin of the project (`?project=`).
"""

from __future__ import annotations

import json
from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import BadRequest, Forbidden
from feedback.auth import HasAdminScope, Principal
from feedback.models import DataPolicy, Project
from feedback.selectors import project_for_member, role_at_least
from feedback.services import data_policy_of
from feedback.userdata.redaction import BUILTIN, MAX_CUSTOM
from feedback.userdata.selectors import data_overview, user_export_rows
from feedback.userdata.services import consent_opt_out_set, data_policy_set

_USER = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[^\\x00]*$",
         "description": "The id the events carried in 'user' (hashed the same way)."}
USER_BODY = {"type": "object", "required": ["user"], "properties": {"user": _USER}}
OPT_OUT_BODY = {"type": "object", "required": ["user"],
                "properties": {"user": _USER, "opted_out": {"type": "boolean", "default": True}}}
DATA_POLICY_BODY = {"type": "object", "properties": {
    "consent_default": {"type": "string", "enum": [c for c, _ in DataPolicy.CONSENTS]},
    "retention_days": {"type": "integer", "minimum": 1, "maximum": 36_500, "nullable": True},
    "erasure_policy": {"type": "string", "enum": [c for c, _ in DataPolicy.ERASURE_POLICIES]},
    "redactors": {"type": "array", "uniqueItems": True, "items": {"type": "string", "enum": sorted(BUILTIN)}},
    "custom_patterns": {"type": "array", "maxItems": MAX_CUSTOM, "items": {
        "type": "object", "required": ["name", "pattern"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,31}$"},
            # The schema shows the simplest form; classes and bounded repeats are accepted too
            # (e.g. "ACME-[0-9]{6,10}"), anything that could backtrack is a 400 with the fix.
            "pattern": {"type": "string", "pattern": "^[A-Za-z0-9]{1,100}$",
                        "description": "characters and classes with bounded repeats, e.g. ACME-[0-9]{6,10}"}}}},
}}
POLICY_OUT = inline_serializer("DataPolicy", {
    "consent_default": serializers.CharField(), "retention_days": serializers.IntegerField(allow_null=True),
    "erasure_policy": serializers.CharField(), "redactors": serializers.ListField(child=serializers.CharField()),
    "custom_patterns": serializers.ListField(child=serializers.DictField())})


def admin_project(request) -> Project:
    """The project an admin-scope call acts on: the key's own, or `?project=` for a person who is
    an admin of it (a project they are no member of is a 404, like one that does not exist)."""
    if isinstance(request.user, Principal):
        return request.user.project
    slug = request.query_params.get("project")
    if not slug:
        raise BadRequest("which project?", "Pass ?project=<slug> when calling with a logged-in session.")
    project, role = project_for_member(request.user, slug)
    if not role_at_least(role, "admin"):
        raise Forbidden(f"users' data of {slug!r} is for its admins; you are a {role}",
                        "Ask an admin of the project, or use a key with the 'admin' scope.")
    return project


class DataPolicyInput(serializers.Serializer):
    consent_default = serializers.ChoiceField(choices=DataPolicy.CONSENTS, required=False)
    retention_days = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=36_500)
    erasure_policy = serializers.ChoiceField(choices=DataPolicy.ERASURE_POLICIES, required=False)
    redactors = serializers.ListField(child=serializers.CharField(max_length=32), required=False, max_length=8)
    custom_patterns = serializers.ListField(child=serializers.DictField(), required=False, max_length=16)


class DataPolicyApi(APIView):
    """GET /api/v1/data-policy: the project's data policy and data overview; PATCH changes it."""

    permission_classes = [HasAdminScope]
    parser_classes = [JSONParser]

    @extend_schema(operation_id="v1_data_policy_get", responses=inline_serializer("DataOverview", {
        "consent_default": serializers.CharField(), "retention_days": serializers.IntegerField(allow_null=True),
        "erasure_policy": serializers.CharField(), "redactors": serializers.ListField(child=serializers.CharField()),
        "custom_patterns": serializers.ListField(child=serializers.CharField()),
        "trajectories": serializers.IntegerField(), "no_train": serializers.IntegerField(),
        "with_user": serializers.IntegerField(), "no_train_share": serializers.FloatField(allow_null=True),
        "opted_out_users": serializers.IntegerField(), "oldest": serializers.DateTimeField(allow_null=True)}))
    def get(self, request) -> Response:
        overview = data_overview(admin_project(request))
        return Response({**overview, "oldest": overview["oldest"].isoformat() if overview["oldest"] else None})

    @extend_schema(operation_id="v1_data_policy_update", request={"application/json": DATA_POLICY_BODY},
                   responses=POLICY_OUT)
    def patch(self, request) -> Response:
        project = admin_project(request)
        data = DataPolicyInput(data=request.data)
        data.is_valid(raise_exception=True)
        data_policy_set(project, **data.validated_data)
        policy = data_policy_of(project)
        return Response({k: getattr(policy, k) for k in ("consent_default", "retention_days", "erasure_policy",
                                                         "redactors", "custom_patterns")})


class OptOutInput(serializers.Serializer):
    user = serializers.CharField(max_length=255, trim_whitespace=False)
    opted_out = serializers.BooleanField(default=True)


class OptOutApi(APIView):
    """POST /api/v1/consent/opt-outs {"user": ID, "opted_out": true|false}: from the moment it
    answers, no run that starts trains on that user's trajectories or feedback."""

    permission_classes = [HasAdminScope]
    parser_classes = [JSONParser]

    @extend_schema(operation_id="v1_consent_opt_out", request={"application/json": OPT_OUT_BODY},
                   responses=inline_serializer("OptOut", {"opted_out": serializers.BooleanField(),
                                                          "was_opted_out": serializers.BooleanField()}))
    def post(self, request) -> Response:
        project = admin_project(request)
        data = OptOutInput(data=request.data)
        data.is_valid(raise_exception=True)
        before = consent_opt_out_set(project, data.validated_data["user"], data.validated_data["opted_out"])
        return Response({"opted_out": data.validated_data["opted_out"], "was_opted_out": before})


class UserExportApi(APIView):
    """GET /api/v1/users/{user}/export: everything stored about one user, as JSON Lines."""

    permission_classes = [HasAdminScope]

    @extend_schema(operation_id="v1_user_export",
                   responses={(200, "application/jsonl"): OpenApiResponse(
                       response=OpenApiTypes.STR, description="one JSON object a line: the user, their "
                       "trajectories, their feedback")})
    def get(self, request, user: str) -> StreamingHttpResponse:
        project = admin_project(request)
        rows = user_export_rows(project, user)
        response = StreamingHttpResponse((_line(r) for r in rows), content_type="application/jsonl")
        response["Content-Disposition"] = 'attachment; filename="user-export.jsonl"'
        return response


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"
