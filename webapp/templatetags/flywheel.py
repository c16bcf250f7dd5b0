"""Template filters of the dashboard: settings as readable JSON, audit rows as field changes."""

from __future__ import annotations

import json
from typing import Any

from django import template

register = template.Library()

MISSING = "–"


@register.filter
def as_json(value: Any) -> str:
    """Indented JSON with sorted keys (a run's settings as a person reads them; what json cannot
    hold, e.g. a date, as its text)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def _show(value: Any) -> str:
    if value is MISSING:
        return MISSING
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


@register.filter
def field_changes(entry: Any) -> list[dict[str, str]]:
    """An audit row's before → after per field, only the fields that changed (a field one side
    lacks shows as "–"; a side that is null has no fields); a side that is neither is one field,
    "value"."""
    before, after = _fields(entry.before), _fields(entry.after)
    rows = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name, MISSING), after.get(name, MISSING)
        if old != new:
            rows.append({"field": name, "before": _show(old), "after": _show(new)})
    return rows


def _fields(side: Any) -> dict[str, Any]:
    if side is None:
        return {}
    return side if isinstance(side, dict) else {"value": side}
