"""Feedback as training data: rows of the three dataset formats trainers read (TRL's conversational
formats), built from trajectories with their steps and feedback events.

    python manage.py export_dataset --project SLUG --format kto --out kto.jsonl
    GET /api/v1/export?format=kto            (streamed JSON Lines, key with scope `read`)

- `messages`   {"messages": [...]}: the prompt, then the turns as served (supervised fine-tuning).
- `kto`        {"prompt": [...], "completion": [...], "label": bool}: one row per trajectory whose
               latest verdict signal (accept/happy/edit_kept vs reject/sad/followup_dissatisfied)
               says good or bad (unpaired preference: KTO, BCO).
- `preference` {"prompt": [...], "chosen": [...], "rejected": [...]}: pairs from one group (the
               `group` field of sampled rollouts, else the same prompt) that holds both a good and a
               bad completion (DPO and its kin).

Plain functions over model rows: no queries here (the selectors shape and stream them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

Format = Literal["messages", "kto", "preference"]
FORMATS: tuple[Format, ...] = ("messages", "kto", "preference")

POSITIVE = frozenset({"accept", "happy", "edit_kept"})
NEGATIVE = frozenset({"reject", "sad", "followup_dissatisfied"})
# Each good completion is paired with at most this many bad ones of its group (and vice versa):
# a popular prompt with many clicks would otherwise square into thousands of near-equal rows.
MAX_PAIRS_PER_GROUP = 16


def message(role: str, content: Any, tool_calls: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def prompt_messages(trajectory: Any) -> list[dict[str, Any]]:
    return [message(m.get("role", "user"), m.get("content", "")) for m in trajectory.prompt or []]


def completion_messages(trajectory: Any) -> list[dict[str, Any]]:
    """The turns as served, in order (prefetched steps)."""
    return [message(s.role, s.content, s.tool_calls) for s in trajectory.steps.all()]


def verdict(trajectory: Any) -> bool | None:
    """True/False from the latest accept-like or reject-like signal (events prefetched in time
    order); None when the users said neither."""
    label = None
    for event in trajectory.feedback_events.all():
        if event.signal in POSITIVE:
            label = True
        elif event.signal in NEGATIVE:
            label = False
    return label


def group_key(trajectory: Any) -> str:
    extra = trajectory.extra if isinstance(trajectory.extra, dict) else {}
    return str(extra.get("group") or "")


def messages_rows(trajectories: Iterable[Any]) -> Iterator[dict[str, Any]]:
    for t in trajectories:
        completion = completion_messages(t)
        if any(m["role"] == "assistant" for m in completion):
            yield {"messages": prompt_messages(t) + completion}


def kto_rows(trajectories: Iterable[Any]) -> Iterator[dict[str, Any]]:
    for t in trajectories:
        label = verdict(t)
        completion = completion_messages(t)
        if label is not None and completion:
            yield {"prompt": prompt_messages(t), "completion": completion, "label": label}


def preference_rows(groups: Iterable[list[Any]]) -> Iterator[dict[str, Any]]:
    """`groups`: lists of trajectories that answer the same prompt (the selector groups them)."""
    for group in groups:
        good = [t for t in group if verdict(t) is True and t.steps.all()]
        bad = [t for t in group if verdict(t) is False and t.steps.all()]
        if not good or not bad:
            continue
        prompt = prompt_messages(good[0])
        for i in range(min(MAX_PAIRS_PER_GROUP, max(len(good), len(bad)))):
            chosen, rejected = good[i % len(good)], bad[i % len(bad)]
            yield {"prompt": prompt, "chosen": completion_messages(chosen),
                   "rejected": completion_messages(rejected)}


def jsonl(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """One JSON object per line (UTF-8 as is: `datasets` and `jq` read it)."""
    for row in rows:
        yield json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"
