"""HTTP API of users' data that training audits or reads (admin scope): the data policy and the
opt-out list (each change an AuditLog row), which versions learned from a user, a trajectory or a
time window, and erasures. Thin views over training.lineage."""

from __future__ import annotations

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from feedback.auth import HasAdminScope
from feedback.models import DataPolicy
from feedback.userdata.apis import USER_BODY, USER_SCHEMA, admin_project
from feedback.userdata.redaction import BUILTIN, MAX_CUSTOM
from feedback.userdata.selectors import data_overview, data_policy_json
from training.lineage.selectors import lineage_of
from training.lineage.services import consent_opt_out_update, data_policy_update, user_erase

_NO_NUL = RegexValidator(r"^[^\x00]*$", "remove the NUL character")

OPT_OUT_BODY = {"type": "object", "required": ["user"],
                "properties": {"user": USER_SCHEMA, "opted_out": {"type": "boolean", "default": True}}}
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
    "reason": {"type": "string", "maxLength": 1000, "description": "why (kept in the audit log)"},
}}
POLICY_OUT = inline_serializer("DataPolicy", {
    "consent_default": serializers.CharField(), "retention_days": serializers.IntegerField(allow_null=True),
    "erasure_policy": serializers.CharField(), "redactors": serializers.ListField(child=serializers.CharField()),
    "custom_patterns": serializers.ListField(child=serializers.DictField())})

LEARNED = inline_serializer("LearnedVersion", {
    "version": serializers.IntegerField(), "id": serializers.IntegerField(), "state": serializers.CharField(),
    "direct": serializers.BooleanField(help_text="its own run trained on the data (else: its weights continue "
                                                 "from a version that did)"),
    "runs": serializers.ListField(child=serializers.IntegerField())}, many=True)


class LineageQuery(serializers.Serializer):
    user = serializers.CharField(required=False, max_length=255, trim_whitespace=False, validators=[_NO_NUL])
    trajectory = serializers.CharField(required=False, max_length=255, trim_whitespace=False, validators=[_NO_NUL])
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)


class LineageApi(APIView):
    """GET /api/v1/lineage?user=&trajectory=&since=&until=: the versions that learned from that
    data (each filter given narrows it; none: any of the project's data), oldest first."""

    permission_classes = [HasAdminScope]

    @extend_schema(operation_id="v1_lineage", parameters=[LineageQuery],
                   responses=inline_serializer("Lineage", {"versions": LEARNED}))
    def get(self, request) -> Response:
        project = admin_project(request)
        # A parameter sent empty is one left out (the schema's allowEmptyValue).
        query = LineageQuery(data={k: v for k, v in request.query_params.items() if k != "project" and v != ""})
        query.is_valid(raise_exception=True)
        return Response({"versions": [v.as_dict() for v in lineage_of(project, **query.validated_data)]})


class ErasureInput(serializers.Serializer):
    user = serializers.CharField(max_length=255, trim_whitespace=False)


class ErasureApi(APIView):
    """POST /api/v1/erasures {"user": ID}: erases the user's data; answers what was removed and
    the versions that had learned from it (and what the project's policy did with them)."""

    permission_classes = [HasAdminScope]
    parser_classes = [JSONParser]

    @extend_schema(operation_id="v1_erasure_create", request={"application/json": USER_BODY},
                   responses=inline_serializer("ErasureReport", {
                       "erasure": serializers.IntegerField(), "policy": serializers.CharField(),
                       "removed": serializers.DictField(child=serializers.IntegerField()),
                       "export_files_rewritten": serializers.IntegerField(),
                       "versions": serializers.ListField(child=serializers.DictField()),
                       "retrain": serializers.DictField(allow_null=True, help_text=(
                           "under the retrain policy: production (the version now serving), production_clean, "
                           "retired and rejected (version numbers); null under keep or flag"))}))
    def post(self, request) -> Response:
        project = admin_project(request)
        data = ErasureInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(user_erase(project, data.validated_data["user"], request.user).as_dict())


class DataPolicyInput(serializers.Serializer):
    consent_default = serializers.ChoiceField(choices=DataPolicy.CONSENTS, required=False)
    retention_days = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=36_500)
    erasure_policy = serializers.ChoiceField(choices=DataPolicy.ERASURE_POLICIES, required=False)
    redactors = serializers.ListField(child=serializers.CharField(max_length=32), required=False, max_length=8)
    custom_patterns = serializers.ListField(child=serializers.DictField(), required=False, max_length=16)
    reason = serializers.CharField(required=False, allow_blank=True, max_length=1000)


class DataPolicyApi(APIView):
    """GET /api/v1/data-policy: the project's data policy and data overview; PATCH changes it
    (one AuditLog row with the fields that changed, before and after, and the optional reason)."""

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
        fields = dict(data.validated_data)
        reason = fields.pop("reason", "")
        data_policy_update(project, request.user, reason, **fields)
        return Response(data_policy_json(project))


class OptOutInput(serializers.Serializer):
    user = serializers.CharField(max_length=255, trim_whitespace=False)
    opted_out = serializers.BooleanField(default=True)


class OptOutApi(APIView):
    """POST /api/v1/consent/opt-outs {"user": ID, "opted_out": true|false}: from the moment it
    answers, no run that starts trains on that user's trajectories or feedback. Audited: the row
    names the user by a peppered reference, never by their id or stored hash."""

    permission_classes = [HasAdminScope]
    parser_classes = [JSONParser]

    @extend_schema(operation_id="v1_consent_opt_out", request={"application/json": OPT_OUT_BODY},
                   responses=inline_serializer("OptOut", {"opted_out": serializers.BooleanField(),
                                                          "was_opted_out": serializers.BooleanField()}))
    def post(self, request) -> Response:
        project = admin_project(request)
        data = OptOutInput(data=request.data)
        data.is_valid(raise_exception=True)
        before = consent_opt_out_update(project, data.validated_data["user"], data.validated_data["opted_out"],
                                        request.user)
        return Response({"opted_out": data.validated_data["opted_out"], "was_opted_out": before})
