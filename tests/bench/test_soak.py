"""bench/soak.py's verdict: the reconciliation of the senders' logs with the database, the chaos
plan, and the events it sends. (The soak itself starts every process of the product and runs for
minutes: it is a benchmark, run by hand; see its docstring.)"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime

import pytest

from bench.soak import chaos_plan, make_batch, read_sender_logs, reconcile
from core import embedded
from feedback.events import parse_event


def _log(*entries: dict) -> list[str]:
    return [json.dumps(e) for e in entries]


def test_a_clean_run_is_ok_and_counts_a_retried_delivery_once():
    deliveries = read_sender_logs(_log(
        {"send": "w1", "ids": ["a", "b"]},
        {"ack": "w1", "statuses": {"a": "accepted", "b": "accepted"}, "attempts": 3},
        {"send": "w2", "ids": ["c"]},
        {"ack": "w2", "statuses": {"c": "duplicate"}, "attempts": 1},  # stored by a delivery whose answer was lost
    ))
    verdict = reconcile(deliveries, Counter({"a": 1, "b": 1, "c": 1}), ["t1"], Counter({"t1": 1}), {"a": 1})
    assert verdict.ok
    assert (verdict.sent, verdict.acked, verdict.stored, verdict.retried, verdict.served) == (3, 3, 3, 1, 1)


def test_it_names_every_way_of_losing_or_doubling():
    deliveries = read_sender_logs(_log(
        {"send": "w1", "ids": ["lost", "twice", "steps-twice"]},
        {"ack": "w1", "statuses": {"lost": "accepted", "twice": "accepted", "steps-twice": "accepted"}},
        {"send": "w2", "ids": ["never"]},
        {"send": "w3", "ids": ["refused"]},
        {"ack": "w3", "statuses": {"refused": "rejected"}},
    ))
    stored = Counter({"twice": 2, "steps-twice": 1, "stranger": 1})
    verdict = reconcile(deliveries, stored, ["t1", "t2"], Counter({"t1": 1}), {"steps-twice": 2})
    assert not verdict.ok
    assert (verdict.lost, verdict.duplicates, verdict.unacked, verdict.rejected, verdict.phantom,
            verdict.served_lost) == (1, 2, 1, 1, 1, 1)
    assert verdict.examples["lost"] == ["lost"] and verdict.examples["served_lost"] == ["t2"]
    assert set(verdict.examples["duplicates"]) == {"twice", "steps-twice"}


def test_a_log_line_cut_by_a_crash_is_skipped():
    lines = _log({"send": "w1", "ids": ["a"]}, {"ack": "w1", "statuses": {"a": "accepted"}}) + ['{"send": "w2", "id']
    deliveries = read_sender_logs(lines)
    assert list(deliveries) == ["w1"] and deliveries["w1"].acked


def test_the_chaos_plan_is_seeded_and_crashes_each_store_once():
    plan = chaos_plan(300, web_kills=3, worker_kills=2, seed=7)
    assert plan == chaos_plan(300, web_kills=3, worker_kills=2, seed=7)
    actions = Counter(action for _, action in plan)
    assert actions == {"kill web": 3, "kill worker": 2, "crash postgres": 1, "restart redis": 1}
    assert all(30 <= at <= 270 for at, _ in plan)
    at = {action: t for t, action in plan}
    assert at["crash postgres"] < at["restart redis"]


def test_the_soak_sends_events_the_contract_accepts():
    now = datetime(2026, 11, 30, tzinfo=UTC)
    batch = make_batch(sender=1, number=3, size=10)
    assert len(batch) == 10 and len({e["id"] for e in batch}) == 10
    for event in batch:
        parse_event(event, now, "salt")  # raises EventError on anything the server would reject


def test_a_stop_mode_pg_ctl_does_not_know_is_refused():
    with pytest.raises(ValueError, match="unknown pg_ctl stop mode"):
        embedded.stop_postgres(mode="crash")  # refused before anything is stopped
