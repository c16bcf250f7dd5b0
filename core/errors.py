"""One error path: ApplicationError subclasses become JSON responses in one handler.

Every 4xx body is {"error": {"code", "message", "fix"}}: what was wrong and how to fix it.
Unknown exceptions stay 500s (and are bugs), except one: a database that cannot be reached (or
that gave up on a statement) is a 503 with `Retry-After`, as JSON on the API and as a page on
the dashboard (`store_unavailable`, `StoreUnavailableMiddleware`, `server_error`).
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

# The types live in core/problems.py (no Django: the serving process raises them too); here they
# are rendered. Re-exported: `from core.errors import BadRequest` is how the apps import them.
from core.problems import (
    ApplicationError,
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
)

__all__ = ["ApplicationError", "BadRequest", "Conflict", "Forbidden", "NotFound", "PayloadTooLarge", "RateLimited",
           "ServiceUnavailable", "Unauthorized", "error_response", "exception_handler", "refuse_repeated",
           "store_unavailable"]


# What a database outage raises: the server is down or restarting (connection refused or reset),
# unreachable within connect_timeout, or it cancelled a statement (statement or lock timeout).
STORE_ERRORS = (OperationalError, InterfaceError)
RETRY_AFTER_S = 5

log = logging.getLogger(__name__)


def store_unavailable(exc: BaseException, fix: str = "") -> ServiceUnavailable:
    """The 503 a request gets when the database cannot serve it: what is wrong, and retry."""
    log.warning("database unavailable: %s: %s", type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
    return ServiceUnavailable(
        f"the database is unavailable ({type(exc).__name__}); this request could not be served",
        fix or f"Retry after {RETRY_AFTER_S} seconds (the Retry-After header); the service resumes by itself "
               "when the database is back.",
        extra={"retry_after": RETRY_AFTER_S}, headers={"Retry-After": str(RETRY_AFTER_S)},
    )


_DRF_FIXES = {
    drf_exceptions.NotAuthenticated: "Send 'Authorization: Bearer <api key>' or log in.",
    drf_exceptions.AuthenticationFailed: "Check the API key: it may be revoked or mistyped.",
    drf_exceptions.PermissionDenied: "Use a key or account with the required scope or permission.",
    drf_exceptions.NotFound: "Check the id in the URL.",
    drf_exceptions.MethodNotAllowed: "Use one of the methods listed in the Allow header.",
    drf_exceptions.ValidationError: "Correct the fields listed in 'fields' and send again.",
    drf_exceptions.ParseError: "Send a valid JSON body with Content-Type: application/json.",
    drf_exceptions.UnsupportedMediaType: "Send Content-Type: application/json.",
    drf_exceptions.Throttled: "Wait for the number of seconds in Retry-After and retry.",
}


def refuse_repeated(params: Any, names: Any) -> None:
    """A filter given twice (`?signal=a&signal=b`) is refused, not silently read as its last value."""
    repeated = sorted(name for name in names if len(params.getlist(name)) > 1)
    if repeated:
        raise BadRequest(f"the query parameters {repeated} are given more than once",
                         "Give each filter once, e.g. ?signal=accept.")


def error_response(exc: ApplicationError) -> Response:
    response = Response(exc.as_body(), status=exc.status_code)
    for name, value in exc.headers.items():
        response[name] = value
    return response


def exception_handler(exc: Exception, context: dict) -> Response | None:
    # Imported here: rest_framework.views imports the authentication classes, which import us.
    from rest_framework.views import exception_handler as drf_exception_handler

    if isinstance(exc, ApplicationError):
        return error_response(exc)
    if isinstance(exc, STORE_ERRORS):
        return error_response(store_unavailable(exc))
    if isinstance(exc, Http404):
        exc = drf_exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = drf_exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    fix = next((f for cls, f in _DRF_FIXES.items() if isinstance(exc, cls)), "")
    detail = exc.detail if isinstance(exc, drf_exceptions.APIException) else str(exc)
    body: dict[str, Any] = {"code": getattr(exc, "default_code", "error"), "fix": fix}
    if isinstance(detail, dict | list):
        body["message"] = "Some fields are invalid."
        body["fields"] = detail
    else:
        body["message"] = str(detail)
    response.data = {"error": body}
    return response


def html_error_response(request: Any, exc: ApplicationError) -> Any:
    """The dashboard's side of the one error path: the same message and fix, as a page."""
    from django.shortcuts import render

    return render(request, "dashboard/error.html", {"error": exc}, status=exc.status_code)


# --- the database away: 503 everywhere, never a 500 trace -------------------------------------

_JSON_PREFIXES = ("/api/", "/healthz", "/metrics", "/internal/")


def store_unavailable_response(request: Any, exc: BaseException) -> HttpResponse:
    """JSON for the API, health and metrics; a page of its own for the dashboard. The page reads
    neither the session nor the user (both live in the database that is away)."""
    from django.template.loader import render_to_string

    error = store_unavailable(exc)
    if request.path.startswith(_JSON_PREFIXES):
        response: HttpResponse = JsonResponse(error.as_body(), status=error.status_code)
    else:
        html = render_to_string("unavailable.html", {"error": error, "retry_after": RETRY_AFTER_S})
        response = HttpResponse(html, status=error.status_code)
    for name, value in error.headers.items():
        response[name] = value
    response["Cache-Control"] = "no-store"
    return response


class StoreUnavailableMiddleware(MiddlewareMixin):
    """A view (or the session and user it loads) that meets a database it cannot reach answers
    503 with Retry-After. Django re-connects on the next request by itself: nothing to reset."""

    def process_exception(self, request: Any, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, STORE_ERRORS):
            return store_unavailable_response(request, exception)
        return None


def server_error(request: Any) -> HttpResponse:
    """handler500: the same 503 for a database error raised outside a view (a middleware saving
    the session); anything else stays a plain 500 (a bug)."""
    import sys

    exc = sys.exc_info()[1]
    if isinstance(exc, STORE_ERRORS):
        return store_unavailable_response(request, exc)
    from django.views.defaults import server_error as django_server_error

    return django_server_error(request)
