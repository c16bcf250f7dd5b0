"""core.notify: pushes from sync code reach the group over one event loop and its pooled Redis
connections, in this process and in a forked child (a Celery pool process)."""

from __future__ import annotations

import asyncio
import os
import time

import redis
from channels.layers import get_channel_layer
from django.conf import settings

from core import notify


def _push(project: int, accepted: int) -> None:
    notify.project_event(project, {"type": "ingest", "accepted": accepted, "duplicate": 0, "rejected": 0})


def _fork_and_push(project: int, accepted: int) -> None:
    pid = os.fork()
    if pid == 0:  # the parent's push thread does not exist here: the child must start its own
        try:
            _push(project, accepted)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


async def _pushed(project: int, pushes) -> list[int]:
    """Joins the project's group, runs each push in a thread of its own (as requests do), and
    returns what the group received, in order."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(notify.project_group(project), channel)
    try:
        got = []
        for push in pushes:
            await asyncio.to_thread(push)
            got.append((await asyncio.wait_for(layer.receive(channel), 10))["payload"]["accepted"])
        return got
    finally:
        await layer.group_discard(notify.project_group(project), channel)


def test_pushes_reach_the_group_over_one_connection():
    address = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]["address"]
    probe = redis.Redis.from_url(address)
    try:
        _push(987654, 0)  # the push loop and its connection exist from here on
        before = probe.info("stats")["total_connections_received"]
        got = asyncio.run(_pushed(987654, [lambda k=k: _push(987654, k) for k in range(20)]))
        assert got == list(range(20))
        # the receiving side opens a connection or two of its own; the pushes opened none (a loop
        # and a connection per push would make it 20 more)
        assert probe.info("stats")["total_connections_received"] - before <= 2
    finally:
        probe.close()


def test_a_forked_child_pushes_on_a_loop_of_its_own():
    _push(987655, 0)  # the parent's push thread is running when the child is forked
    got = asyncio.run(_pushed(987655, [lambda: _push(987655, 1), lambda: _fork_and_push(987655, 2)]))
    assert got == [1, 2]


async def _received(project: int, act, *, settle_s: float) -> list[dict]:
    """Runs `act` in a thread while joined to the project's group; what the group got until
    `settle_s` passed with nothing more."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(notify.project_group(project), channel)
    try:
        await asyncio.to_thread(act)
        got = []
        while True:
            try:
                got.append((await asyncio.wait_for(layer.receive(channel), settle_s))["payload"])
            except TimeoutError:
                return got
    finally:
        await layer.group_discard(notify.project_group(project), channel)


def test_ingest_counts_of_many_batches_are_pushed_summed_without_the_request_waiting():
    def twenty_batches() -> None:
        for k in range(20):
            started = time.perf_counter()
            notify.ingest_pushed(987656, {"accepted": 2, "duplicate": k % 2, "rejected": 0, "feedback": 2})
            assert time.perf_counter() - started < 0.05  # no wait for Redis
    got = asyncio.run(_received(987656, twenty_batches, settle_s=1.5))
    assert 1 <= len(got) <= 3  # a push per INGEST_PUSH_EVERY_S at most, not one a batch
    assert all(p["type"] == "ingest" for p in got)
    assert sum(p["accepted"] for p in got) == 40 and sum(p["duplicate"] for p in got) == 10
    assert sum(p["feedback"] for p in got) == 40
