"""The one error family, without Django: what a request did wrong, its HTTP status, and the fix.

Every layer raises these (or a subclass): the DRF handler (`core.errors.exception_handler`) and
the serving process's OpenAI-shaped answers (`inference.apis`) render the same types, so one
`except ApplicationError` catches a refusal wherever it came from. The serving process and the
engines may not import Django (pyproject's import contracts): this module imports nothing.

    raise BadRequest("the field 'n' must be a positive integer", "Send n >= 1, e.g. 4.")
    raise problem(409, "the replica holds other weights", "Push the whole set first.")
"""

from __future__ import annotations

from typing import Any


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

    @property
    def status(self) -> int:
        """The HTTP status (the name the serving side and its clients use)."""
        return self.status_code

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


_BY_STATUS = {cls.status_code: cls for cls in (BadRequest, Unauthorized, Forbidden, NotFound, Conflict,
                                               PayloadTooLarge, RateLimited, ServiceUnavailable)}
_CODES = {405: "method_not_allowed", 415: "unsupported_media_type", 422: "unprocessable", 500: "server_error",
          502: "bad_gateway", 504: "timeout"}


def status_code_name(status: int) -> str:
    """The family's code for an HTTP status (`bad_request` for 400, ...; `error_<status>` if none)."""
    known = _BY_STATUS.get(status)
    return known.code if known is not None else _CODES.get(status, f"error_{status}")


def problem(status: int, message: str, fix: str = "", headers: dict[str, str] | None = None) -> ApplicationError:
    """The family's error for an HTTP status: BadRequest for 400, Conflict for 409, ..."""
    kind = _BY_STATUS.get(status)
    if kind is not None:
        return kind(message, fix, headers=headers)
    out = ApplicationError(message, fix, headers=headers)
    out.status_code, out.code = status, status_code_name(status)
    return out
