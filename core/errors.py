"""One error path: ApplicationError subclasses become JSON responses in one handler.

Every 4xx body is {"error": {"code", "message", "fix"}}: what was wrong and how to fix it.
Unknown exceptions stay 500s (and are bugs).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response


class ApplicationError(Exception):
    status_code = 400
    code = "bad_request"

    def __init__(self, message: str, fix: str = "", *, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.extra = extra or {}
        self.headers = headers or {}

    def as_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "fix": self.fix, **self.extra}}


class BadRequest(ApplicationError):
    status_code, code = 400, "bad_request"


class Unauthorized(ApplicationError):
    status_code, code = 401, "unauthorized"


class Forbidden(ApplicationError):
    status_code, code = 403, "forbidden"


class NotFound(ApplicationError):
    status_code, code = 404, "not_found"


class Conflict(ApplicationError):
    status_code, code = 409, "conflict"


class PayloadTooLarge(ApplicationError):
    status_code, code = 413, "payload_too_large"


class RateLimited(ApplicationError):
    status_code, code = 429, "rate_limited"


class ServiceUnavailable(ApplicationError):
    status_code, code = 503, "unavailable"


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
