"""HTTP API of corpora: POST /api/v1/corpora (admin) takes the project's code as a tar/zip archive
(the body, or one multipart file) or as text files (multipart), ≤ FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES;
GET lists the project's corpora. A thin view over training.corpora.services.

    curl -X POST -H "Authorization: Bearer $ADMIN_KEY" -H 'Content-Type: application/gzip' \
         --data-binary @repo.tar.gz 'http://localhost:8000/api/v1/corpora?name=repo'
"""

from __future__ import annotations

import tempfile
from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import BadRequest, Forbidden, PayloadTooLarge, refuse_repeated
from feedback.auth import HasAdminScope, HasReadScope, Principal
from feedback.models import Project
from feedback.selectors import project_for_member
from training.corpora.selectors import corpus_list
from training.corpora.services import DEFAULT_HELDOUT_PERCENT, corpus_add_upload
from training.models import Corpus

ARCHIVE_TYPES = ("application/gzip", "application/x-gzip", "application/x-tar", "application/zip",
                 "application/x-bzip2", "application/x-xz", "application/octet-stream")


def caller_project(request: Any, role: str | None = None) -> tuple[Project, Any]:
    """The project the call is for and who acts: a key's own project and owner, or a session's
    ?project= (with at least `role` in it)."""
    if isinstance(request.user, Principal):
        return request.user.project, request.user.owner
    slug = request.GET.get("project")
    if not slug:
        raise BadRequest("which project?", "Pass ?project=<slug> when calling with a logged-in session.")
    project, have = project_for_member(request.user, slug)
    if role == "admin" and have != "admin":
        raise Forbidden(f"adding a corpus to {slug!r} needs the admin role (you are {have})",
                        "Ask an admin of the project, or use an API key with scope 'admin'.")
    return project, request.user


class CorpusOutput(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    files = serializers.IntegerField(source="files_count")
    heldout_files = serializers.SerializerMethodField()
    heldout_percent = serializers.IntegerField()
    bytes = serializers.IntegerField()
    tokens = serializers.IntegerField(allow_null=True)
    heldout_tokens = serializers.IntegerField(allow_null=True)
    skipped = serializers.JSONField()
    created_at = serializers.DateTimeField()

    def get_heldout_files(self, corpus: Corpus) -> int:
        return getattr(corpus, "heldout_files", None) or corpus.files.filter(heldout=True).count()


class CorpusApi(APIView):
    """GET /api/v1/corpora: the project's corpora. POST: a new corpus from an upload."""

    parser_classes = [MultiPartParser]

    def get_permissions(self):
        return [HasAdminScope()] if self.request.method == "POST" else [HasReadScope()]

    class QuerySerializer(serializers.Serializer):
        project = serializers.CharField(required=False)
        name = serializers.CharField(max_length=200, required=False, default="upload")
        heldout_percent = serializers.IntegerField(min_value=0, max_value=50, required=False,
                                                   default=DEFAULT_HELDOUT_PERCENT)

    @extend_schema(operation_id="v1_corpora_list",
                   responses=inline_serializer("CorpusList", {"results": CorpusOutput(many=True)}))
    def get(self, request) -> Response:
        project, _ = caller_project(request)
        return Response({"results": CorpusOutput(corpus_list(project), many=True).data})

    @extend_schema(
        parameters=[OpenApiParameter("name", str), OpenApiParameter("heldout_percent", int)],
        request={"application/gzip": {"type": "string", "format": "binary"},
                 "multipart/form-data": {"type": "object", "properties": {
                     "files": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
        responses={201: CorpusOutput})
    def post(self, request) -> Response:
        refuse_repeated(request.query_params, self.QuerySerializer().fields)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        project, actor = caller_project(request, role="admin")
        _length_check(request)
        opts = {"name": query.validated_data["name"], "heldout_percent": query.validated_data["heldout_percent"],
                "created_by": actor if getattr(actor, "pk", None) else None}
        content_type = request.content_type.split(";")[0].strip().lower()
        if content_type == "multipart/form-data":
            corpus = _from_multipart(request, project, opts)
        elif content_type in ARCHIVE_TYPES:
            with tempfile.SpooledTemporaryFile(max_size=8 * 2**20) as spool:
                _copy_bounded(request.stream, spool)
                corpus = corpus_add_upload(project, archive=spool, **opts)
        else:
            raise BadRequest(f"cannot read a corpus from Content-Type {content_type or 'none'!r}",
                             "Send a tar/zip archive as the body (Content-Type: application/gzip, application/x-tar "
                             "or application/zip), or text files as multipart/form-data field 'files'.")
        return Response(CorpusOutput(corpus).data, status=201)


def _length_check(request: Any) -> None:
    limit = settings.FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length <= 0:
        raise BadRequest("the upload has no Content-Length", "Send the body with its Content-Length (curl does).")
    if length > limit:
        raise PayloadTooLarge(f"the upload is {length:,} bytes, more than {limit:,}",
                              "Send only the sources (e.g. git archive HEAD), or raise FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES.")


def _copy_bounded(stream: Any, spool: Any) -> None:
    limit, total = settings.FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES, 0
    while chunk := stream.read(2**20) if stream is not None else b"":
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"the upload is more than {limit:,} bytes",
                                  "Send only the sources, or raise FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES.")
        spool.write(chunk)
    spool.seek(0)


def _from_multipart(request: Any, project: Project, opts: dict[str, Any]) -> Corpus:
    files = request.FILES.getlist("files")
    if not files:
        raise BadRequest("the form has no 'files'", "Send the text files (or one archive) as form field 'files'.")
    if len(files) == 1 and files[0].name.lower().endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")):
        return corpus_add_upload(project, archive=files[0], **opts)
    return corpus_add_upload(project, uploads=[(f.name, f.read()) for f in files], **opts)
