"""HTTP API of the training lineage of users' data (admin scope): which versions learned from a
user, a trajectory or a time window, and erasures. Thin views over training.lineage."""

from __future__ import annotations

from django.core.validators import RegexValidator
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from feedback.auth import HasAdminScope
from feedback.userdata.apis import USER_BODY, admin_project
from training.lineage.selectors import lineage_of
from training.lineage.services import user_erase

_NO_NUL = RegexValidator(r"^[^\x00]*$", "remove the NUL character")

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
    the versions that had learned from it (and the project's policy for them)."""

    permission_classes = [HasAdminScope]
    parser_classes = [JSONParser]

    @extend_schema(operation_id="v1_erasure_create", request={"application/json": USER_BODY},
                   responses=inline_serializer("ErasureReport", {
                       "erasure": serializers.IntegerField(), "policy": serializers.CharField(),
                       "removed": serializers.DictField(child=serializers.IntegerField()),
                       "export_files_rewritten": serializers.IntegerField(),
                       "versions": serializers.ListField(child=serializers.DictField())}))
    def post(self, request) -> Response:
        project = admin_project(request)
        data = ErasureInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(user_erase(project, data.validated_data["user"], request.user).as_dict())
