"""One way to read a value from a URL: a query parameter, a path segment or a pagination cursor's
field. Every malformed value is a 400 (`BadRequest`) that says what was wrong and how to fix it,
never a 500 from `int()`, a calendar, or PostgreSQL (which cannot hold a NUL in text).

    days = query_int(request.GET, "days", 14, low=1, high=90)
    task = query_text(request.GET, "task")
    at = query_datetime(request.GET, "at")

Used by the dashboard's views (webapp/views.py, webapp/rollouts.py `RolloutFilter`), the read
API's path and cursor (feedback/apis.py) and the projects' slugs (feedback/selectors.py).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from core.errors import BadRequest

MAX_DIGITS = 18  # any integer the database holds (bigint) has at most 19; 18 never overflows it
MAX_TEXT = 200


def _raw(params: Any, name: str) -> str:
    raw = params.get(name, "")
    return raw if isinstance(raw, str) else ""


def parse_int(raw: str, name: str, low: int, high: int) -> int:
    """`raw` as an integer in [low, high]: ASCII digits only (`str.isdigit` also takes '²' and
    other digits `int()` refuses), few enough that `int()` never meets its 4,300-digit bound."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= MAX_DIGITS) or not low <= int(raw) <= high:
        raise BadRequest(f"{name}={_shown(raw)} is not a whole number between {low} and {high}",
                         f"Give {name} as digits, e.g. {name}={low}.")
    return int(raw)


def query_int(params: Any, name: str, default: int | None, low: int = 1, high: int = 10**12) -> int | None:
    raw = _raw(params, name)
    return default if raw == "" else parse_int(raw, name, low, high)


def text(raw: str, name: str, max_length: int = MAX_TEXT) -> str:
    """`raw` as text the database can hold and compare: no NUL, at most `max_length` characters."""
    if "\x00" in raw:
        raise BadRequest(f"{name} contains a NUL character", f"Remove the NUL (%00) from {name}.")
    if len(raw) > max_length:
        raise BadRequest(f"{name} is {len(raw)} characters long; at most {max_length} are accepted",
                         f"Shorten {name} to at most {max_length} characters.")
    return raw


def query_text(params: Any, name: str, max_length: int = MAX_TEXT) -> str:
    return text(_raw(params, name), name, max_length)


def query_float(params: Any, name: str) -> float | None:
    """A finite number, or None when the parameter is absent or empty."""
    raw = _raw(params, name)
    if raw == "":
        return None
    try:
        value = float(raw) if len(raw) <= 64 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise BadRequest(f"{name}={_shown(raw)} is not a finite number", f"Give {name} as a number, e.g. {name}=0.5.")
    return value


def parse_datetime_strict(raw: str, name: str) -> datetime:
    """`raw` as an aware date and time (naive: the current time zone); a date that is not on the
    calendar (2026-02-30) or not ISO 8601 is a 400."""
    try:
        when = parse_datetime(raw) if len(raw) <= 64 else None
        when = when if when is None or timezone.is_aware(when) else timezone.make_aware(when)
        when = when and when.astimezone(UTC)  # the database compares in UTC: year 1 or 9999 may not fit
    except (ValueError, OverflowError):  # the shape matched, the calendar did not
        when = None
    if when is None:
        raise BadRequest(f"{name}={_shown(raw)} is not a date and time on the calendar",
                         f"Use ISO 8601, e.g. {name}=2026-11-29T08:00.")
    return when


def query_datetime(params: Any, name: str) -> datetime | None:
    raw = _raw(params, name)
    return None if raw == "" else parse_datetime_strict(raw, name)


def _shown(raw: str) -> str:
    return repr(raw) if len(raw) <= 40 else repr(raw[:37]) + "..."
