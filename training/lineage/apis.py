"""HTTP API of the training lineage of users' data (admin scope): which versions learned from a
user, a trajectory or a time window, and erasures. Thin views over training.lineage."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import BadRequest
from feedback.auth import HasAdminScope
from feedback.userdata.apis import admin_project
from training.lineage.selectors import lineage_of
from training.lineage.services import user_erase


class LineageQuery(serializers.Serializer):
    user = serializers.CharField(required=False, max_length=255, trim_whitespace=False)
    trajectory = serializers.CharField(required=False, max_length=255, trim_whitespace=False)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)

    def validate(self, attrs):
        given = [k for k in ("user", "trajectory") if k in attrs] + (["window"] if {"since", "until"} & set(attrs)
                                                                     else [])
        if len(given) != 1:
            raise BadRequest("name exactly one of: a user, a trajectory, a time window",
                             "Pass ?user=ID, ?trajectory=ID, or ?since=ISO and/or ?until=ISO.")
        return attrs


class LineageApi(APIView):
    """GET /api/v1/lineage?user=|trajectory=|since=&until=: the versions that learned from it."""

    permission_classes = [HasAdminScope]

    @extend_schema(operation_id="v1_lineage", parameters=[LineageQuery],
                   responses={200: OpenApiResponse(description="versions, oldest first")})
    def get(self, request) -> Response:
        project = admin_project(request)
        query = LineageQuery(data={k: v for k, v in request.query_params.items() if k != "project"})
        query.is_valid(raise_exception=True)
        return Response({"versions": [v.as_dict() for v in lineage_of(project, **query.validated_data)]})


class ErasureInput(serializers.Serializer):
    user = serializers.CharField(max_length=255, trim_whitespace=False)


class ErasureApi(APIView):
    """POST /api/v1/erasures {"user": ID}: erases the user's data; answers what was removed and
    the versions that had learned from it (and what the project's policy did about them)."""

    permission_classes = [HasAdminScope]

    @extend_schema(operation_id="v1_erasure_create", request=ErasureInput,
                   responses={201: OpenApiResponse(description="the erasure's report")})
    def post(self, request) -> Response:
        project = admin_project(request)
        data = ErasureInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(user_erase(project, data.validated_data["user"], request.user).as_dict(), status=201)
