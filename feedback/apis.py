"""HTTP API of the feedback app: the ingest webhook and the read API."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from itertools import islice
from typing import Any

import msgspec
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.asgi import ASGIRequest
from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import RegexValidator
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import exceptions as drf_exceptions
from rest_framework import serializers
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from core import dbthreads
from core.errors import (
    RETRY_AFTER_S,
    STORE_ERRORS,
    BadRequest,
    Forbidden,
    PayloadTooLarge,
    Unauthorized,
    refuse_repeated,
    store_unavailable,
)
from core.notify import ingest_pushed
from core.params import parse_datetime_strict, text
from feedback import export, selectors
from feedback.auth import (
    PROJECT_HEADER,
    HasReadScope,
    Principal,
    api_key_principal,
    bearer_token,
    webhook_principal,
)
from feedback.event_schema import EVENT_BATCH, EVENT_RESULTS
from feedback.events import MAX_DEPTH
from feedback.ratelimit import ingest_rate_check
from feedback.services import feedback_ingest


class IngestApi(APIView):
    """POST /api/v1/events: a batch of trajectory and feedback events (DESIGN.md, ingest contract)."""

    authentication_classes: list = []
    permission_classes: list = []

    @extend_schema(
        summary="Send trajectories and feedback",
        request={"application/json": EVENT_BATCH},
        responses={202: EVENT_RESULTS},
    )
    def post(self, request) -> Response:
        body = _body(request)
        threads = settings.INGEST_DB_THREADS
        if threads and isinstance(request._request, ASGIRequest):
            # Under ASGI each request is a new thread, hence a new connection: the database work
            # goes to threads that keep theirs (core.dbthreads). Its answer, or its error, comes
            # back here; the transaction committed (or rolled back) before that.
            return dbthreads.run("ingest", threads, lambda: _ingest(request, body))
        return _ingest(request, body)


def _ingest(request, body: bytes) -> Response:
    try:
        # The key or secret is looked up in the database too: an outage answers 503 there as well.
        principal = _principal(request, body)
        events = _events(body)
        ingest_rate_check(principal.project, len(events))
        webhook_id = request.headers.get("webhook-id") if principal.via == "webhook" else None
        results = feedback_ingest(principal.project, events, webhook_id=webhook_id,
                                  on_commit=_notifier(principal.project.id))
    except STORE_ERRORS as exc:
        raise store_unavailable(
            exc, f"Retry after {RETRY_AFTER_S} seconds (Retry-After) with the same body and webhook-id; "
                 "nothing from this request was stored, and events stored before are answered as duplicates.",
        ) from exc
    counts = {s: sum(1 for r in results if r.status == s) for s in ("accepted", "duplicate", "rejected")}
    return Response({"results": [r.as_dict() for r in results], **counts}, status=202)


_BYTE_COUNT = re.compile(r"[0-9]+")


def _body(request) -> bytes:
    length = request.META.get("CONTENT_LENGTH") or ""
    limit = settings.INGEST_MAX_BODY_BYTES
    if length and not _BYTE_COUNT.fullmatch(length):
        # Django would int() it while reading the body, and fail with a 500.
        raise BadRequest(f"the Content-Length header {length[:40]!r} is not a number of bytes",
                         "Send the body's size in bytes as Content-Length (or let the HTTP client set it).")
    if length and (len(length) > 18 or int(length) > limit):
        raise PayloadTooLarge(f"the body is {length[:40]} bytes; at most {limit} (5 MiB) are accepted",
                              f"Split the batch into requests of at most {limit} bytes.")
    try:
        return request.body
    except RequestDataTooBig:
        raise PayloadTooLarge(f"the body is over {limit} bytes (5 MiB)", "Split the batch into smaller requests.") from None


def _principal(request, body: bytes) -> Principal:
    if request.headers.get("webhook-signature") or request.headers.get("webhook-id"):
        slug = request.headers.get(PROJECT_HEADER) or request.GET.get("project")
        return webhook_principal(slug, _utf8(body), {k.lower(): v for k, v in request.headers.items()})
    token = bearer_token(request.headers.get("authorization", ""))
    if token is None:
        raise Unauthorized(
            "the request is neither signed nor carries an API key",
            "Sign it with Standard Webhooks (webhook-id, webhook-timestamp, webhook-signature and "
            f"{PROJECT_HEADER}) or send 'Authorization: Bearer <key with ingest scope>'.",
        )
    principal = api_key_principal(token)
    if not principal.has_scope("ingest"):
        raise Forbidden("this API key lacks the 'ingest' scope",
                        "Use a key created with scope 'ingest' (manage.py create_key --scopes ingest).")
    return principal


def _utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8 (byte {exc.start} cannot be decoded)",
                         'Send {"events": [...]} as JSON encoded in UTF-8 (not UTF-16 or Latin-1).') from None


def _events(body: bytes) -> list[Any]:
    try:
        # NaN and Infinity parse to floats here so that one bad event is refused alone, below.
        data = _json_loads(_utf8(body).removeprefix("\ufeff"))
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deep to parse",
                         f"Nest values at most {MAX_DEPTH} levels deep inside an event.") from None
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})",
                         'Send {"events": [...]} encoded as UTF-8 JSON.') from None
    if not isinstance(data, dict) or "events" not in data:
        raise BadRequest("the body is not a batch", 'Send a JSON object {"events": [...]}.')
    events = data["events"]
    if not isinstance(events, list):
        raise BadRequest(f"'events' must be a list, got {type(events).__name__}", 'Send {"events": [{...}, ...]}.')
    if not events:
        raise BadRequest("'events' is empty", "Send at least one event.")
    limit = settings.INGEST_MAX_EVENTS
    if len(events) > limit:
        raise PayloadTooLarge(f"the batch has {len(events)} events; at most {limit} are accepted",
                              f"Split it into batches of at most {limit} events.")
    return events


_STRICT_JSON = msgspec.json.Decoder()


def _json_loads(text: str) -> Any:
    # msgspec first: a batch decodes in about a third of json.loads's time, to the same values
    # (tested on generated JSON). It takes only strict JSON whose numbers fit a float and whose
    # integers have at most 4,300 digits; anything else (NaN, Infinity, 1e400, a lone surrogate,
    # deep nesting, a malformed body) falls through to json.loads, whose answers and errors stay
    # the contract.
    try:
        return _STRICT_JSON.decode(text)
    except (ValueError, RecursionError):  # msgspec's DecodeError is a ValueError; so is a lone surrogate's
        pass
    try:
        return json.loads(text)
    except ValueError:
        # Python refuses integers of over 4,300 digits, which would fail the whole batch. Any
        # integer of over 309 digits is beyond the float range: parsed as +-inf, its event is
        # refused alone. (Only on this path: the hook costs a call per integer.)
        return json.loads(text, parse_int=lambda s: int(s) if len(s) <= 310 else float(s))


def _notifier(project_id: int):
    def notify(counts: dict[str, int]) -> None:
        ingest_pushed(project_id, counts)

    return notify


# --- read API -----------------------------------------------------------------------------------


class StepOutput(serializers.Serializer):
    """A step; its per-token arrays hold at most READ_MAX_TOKENS_PER_STEP items (the first ones):
    `token_count` says how many the step has and `tokens_truncated` whether some were left out."""

    index = serializers.IntegerField()
    role = serializers.CharField()
    content = serializers.CharField()
    tool_calls = serializers.JSONField()
    token_ids = serializers.JSONField(source="token_ids_head")
    logprobs = serializers.JSONField(source="logprobs_head")
    routing = serializers.JSONField(source="routing_head")
    token_count = serializers.IntegerField()
    tokens_truncated = serializers.SerializerMethodField()
    reward = serializers.FloatField(allow_null=True)

    def get_tokens_truncated(self, step) -> bool:
        return step.token_count > settings.READ_MAX_TOKENS_PER_STEP


class FeedbackOutput(serializers.Serializer):
    id = serializers.CharField(source="event_id")
    signal = serializers.CharField()
    value = serializers.FloatField(allow_null=True)
    step = serializers.IntegerField(allow_null=True)
    user = serializers.CharField(source="user_hash")
    aspect_labels = serializers.JSONField()
    occurred_at = serializers.DateTimeField()
    received_at = serializers.DateTimeField()


class TrajectoryOutput(serializers.Serializer):
    id = serializers.CharField(source="external_id")
    policy_version = serializers.IntegerField(allow_null=True)
    source = serializers.CharField()
    task = serializers.CharField()
    tags = serializers.JSONField()
    prompt = serializers.JSONField()
    occurred_at = serializers.DateTimeField()
    received_at = serializers.DateTimeField()
    steps = StepOutput(many=True)
    feedback = FeedbackOutput(many=True, source="feedback_events")


class TrajectoryPagination(CursorPagination):
    """At most `limit` rows (500) and READ_PAGE_MAX_BYTES of JSON per page: a page that would
    grow past the bytes ends early (never empty) and its `next` cursor continues after it."""

    ordering = ("-occurred_at", "-id")
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500

    def decode_cursor(self, request):
        """DRF's cursor, its position checked: a forged `p` (not a time) is a 400 here, not a
        500 from the database comparing it with `occurred_at`."""
        raw = request.query_params.get(self.cursor_query_param, "")
        try:
            cursor = super().decode_cursor(request)
            if cursor is not None and cursor.position is not None:
                parse_datetime_strict(text(cursor.position, "cursor"), "cursor")
        except (drf_exceptions.NotFound, BadRequest):
            raise BadRequest(f"cursor={raw[:40]!r} is not a cursor this API gave", _CURSOR_FIX) from None
        return cursor

    def serialize_within_bytes(self, rows: list[Any], serialize) -> list[dict[str, Any]]:
        budget, used, out = settings.READ_PAGE_MAX_BYTES, 0, []
        for row in rows:
            item = serialize(row)
            size = len(json.dumps(item, cls=DjangoJSONEncoder, separators=(",", ":")))
            if out and used + size > budget:
                # The next cursor continues at the first row left out (DRF builds it from these).
                self.page, self.has_next = self.page[:len(out)], True
                self.next_position = self._get_position_from_instance(row, self.ordering)
                break
            out.append(item)
            used += size
        return out


_CURSOR_FIX = "Follow the `next` or `previous` link of a page as given, or drop `cursor` to start from the newest."
_NO_NUL = RegexValidator(r"^[^\x00]*$", "remove the NUL character (PostgreSQL text cannot hold it)")


class TrajectoryFilter(serializers.Serializer):
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)
    policy_version = serializers.IntegerField(required=False, min_value=0)
    # Filtered on as sent (not trimmed: a value of spaces would trim to a "blank" 400). CharField
    # refuses NUL anyway; the validator puts that into the published schema.
    signal = serializers.CharField(required=False, max_length=64, trim_whitespace=False, validators=[_NO_NUL])
    task = serializers.CharField(required=False, max_length=100, trim_whitespace=False, validators=[_NO_NUL])
    source = serializers.ChoiceField(choices=["live", "simulated", "eval"], required=False)


class TrajectoryPageParams(serializers.Serializer):
    cursor = serializers.CharField(required=False, help_text="The `next` or `previous` link's cursor.")
    limit = serializers.IntegerField(required=False, help_text=(
        f"Rows per page, 1 to {TrajectoryPagination.max_page_size} (other values give "
        f"{TrajectoryPagination.page_size}); a page also ends at READ_PAGE_MAX_BYTES."))


TRAJECTORY_PAGE = inline_serializer("TrajectoryPage", {
    "next": serializers.URLField(allow_null=True), "previous": serializers.URLField(allow_null=True),
    "results": TrajectoryOutput(many=True)})


def _project_of(request):
    principal = request.user
    if isinstance(principal, Principal):
        return principal.project
    slug = request.GET.get("project")
    if not slug:
        raise BadRequest("which project?", "Pass ?project=<slug> when reading with a logged-in session.")
    # A project the account is no member of answers 404, like one that does not exist.
    return selectors.project_for_member(request.user, slug)[0]


class TrajectoryListApi(APIView):
    """GET /api/v1/trajectories: newest first, cursor-paginated, with steps and feedback."""

    permission_classes = [HasReadScope]

    @extend_schema(parameters=[TrajectoryFilter, TrajectoryPageParams], operation_id="v1_trajectories_list",
                   responses=TRAJECTORY_PAGE)
    def get(self, request) -> Response:
        refuse_repeated(request.query_params, TrajectoryFilter().fields)
        filters = TrajectoryFilter(data=request.query_params)
        filters.is_valid(raise_exception=True)
        queryset = selectors.trajectory_list(_project_of(request), **filters.validated_data,
                                             max_tokens=settings.READ_MAX_TOKENS_PER_STEP)
        paginator = TrajectoryPagination()
        page = paginator.paginate_queryset(queryset, request, view=self)
        rows = paginator.serialize_within_bytes(page, lambda t: TrajectoryOutput(t).data)
        return paginator.get_paginated_response(rows)


class TrajectoryDetailApi(APIView):
    """GET /api/v1/trajectories/{id}: one trajectory by the id the product gave it."""

    permission_classes = [HasReadScope]

    @extend_schema(responses=TrajectoryOutput, parameters=[OpenApiParameter("external_id", str, "path")])
    def get(self, request, external_id: str) -> Response:
        external_id = text(external_id, "the trajectory id in the path", 255)
        trajectory = selectors.trajectory_get(_project_of(request), external_id,
                                              max_tokens=settings.READ_MAX_TOKENS_PER_STEP)
        return Response(TrajectoryOutput(trajectory).data)


class ExportFilter(TrajectoryFilter):
    format = serializers.ChoiceField(choices=list(export.FORMATS))


class DatasetExportApi(APIView):
    """GET /api/v1/export?format=messages|kto|preference: the dataset as streamed JSON Lines
    (the same rows as `manage.py export_dataset`; filters as on /api/v1/trajectories)."""

    permission_classes = [HasReadScope]

    def perform_content_negotiation(self, request, force: bool = False):
        # `?format=` names the dataset here, not one of DRF's renderers (its URL format override).
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(parameters=[ExportFilter], responses={(200, "application/jsonl"): OpenApiTypes.STR})
    def get(self, request) -> StreamingHttpResponse:
        refuse_repeated(request.query_params, ExportFilter().fields)
        params = ExportFilter(data=request.query_params)
        params.is_valid(raise_exception=True)
        filters = dict(params.validated_data)
        fmt = filters.pop("format")
        lines = export.jsonl(selectors.dataset_rows(_project_of(request), fmt, **filters))
        response = StreamingHttpResponse(_streamed(request, lines), content_type="application/jsonl; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{fmt}.jsonl"'
        return response


def _streamed(request, lines: Iterator[str]) -> Iterator[str] | AsyncIterator[str]:
    """Under ASGI Django would collect a synchronous iterator into a list before sending it; an
    asynchronous one that pulls batches through the request's database thread streams instead."""
    if not isinstance(getattr(request, "_request", request), ASGIRequest):
        return lines

    async def batches() -> AsyncIterator[str]:
        while chunk := await sync_to_async(_take)(lines, 200):
            yield "".join(chunk)

    return batches()


def _take(lines: Iterator[str], n: int) -> list[str]:
    return list(islice(lines, n))
