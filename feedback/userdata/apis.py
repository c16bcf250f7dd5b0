"""HTTP API of users' data (admin scope): a user's subject access export (JSON Lines), and who may
call the users' data API (`admin_project`). The data policy, the opt-out list, erasures and
lineage are training's (training/lineage/apis.py): their changes are audited, and the audit log is
the training app's.

A key needs the `admin` scope; a signed-in person must be an admin of the project (`?project=`).
"""

from __future__ import annotations

import json
from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from core.errors import BadRequest, Forbidden
from feedback.auth import HasAdminScope, Principal
from feedback.models import Project
from feedback.selectors import project_for_member, role_at_least
from feedback.userdata.selectors import user_export_rows

USER_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[^\\x00]*$",
         "description": "The id the events carried in 'user' (hashed the same way)."}
USER_BODY = {"type": "object", "required": ["user"], "properties": {"user": USER_SCHEMA}}


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
