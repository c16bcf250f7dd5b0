"""The URL value parsers (core/params.py): any text is either a value in bounds or a BadRequest
with a fix, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.errors import BadRequest
from core.params import parse_datetime_strict, parse_int, query_float, query_text


@given(st.text(max_size=6000))
def test_parse_int_takes_only_ascii_digits_in_bounds(raw):
    try:
        value = parse_int(raw, "days", 1, 90)
    except BadRequest as exc:
        assert exc.fix
    else:
        assert raw.isascii() and 1 <= value <= 90 and str(value) == raw.lstrip("0")


@given(st.text(max_size=100))
def test_parse_datetime_strict_gives_an_aware_time_or_a_400(raw):
    try:
        when = parse_datetime_strict(raw, "at")
    except BadRequest as exc:
        assert exc.fix
    else:
        assert when.tzinfo is not None


@given(st.text(max_size=300))
def test_query_text_never_passes_a_nul(raw):
    try:
        value = query_text({"task": raw}, "task")
    except BadRequest:
        assert "\x00" in raw or len(raw) > 200
    else:
        assert value == raw


@given(st.text(max_size=80))
def test_query_float_is_finite_or_a_400(raw):
    try:
        value = query_float({"x": raw}, "x")
    except BadRequest:
        return
    assert value is None or value == value and abs(value) != float("inf")


@pytest.mark.parametrize("raw", ["²", "9" * 5000, "-1", " 5", "0x10", "٣"])
def test_the_issue_s_numbers_are_refused(raw):
    with pytest.raises(BadRequest):
        parse_int(raw, "days", 1, 90)


def test_a_date_off_the_calendar_is_refused():
    with pytest.raises(BadRequest, match="calendar"):
        parse_datetime_strict("2026-02-30T00:00", "at")
