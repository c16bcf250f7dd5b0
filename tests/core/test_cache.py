"""core.cache: the rate counters' cache client is one per process, shared by requests, threads and
the contexts each request runs in (Django's own is one per context: a Redis connection a request)."""

from __future__ import annotations

import contextvars
import os
import threading
import time
import uuid

import redis
from django.conf import settings

from core.cache import Tally, count, count_within, shared_cache


def _in_fresh_contexts(fn, times: int) -> None:
    """`fn` once per thread, each in a copy of this context, as ASGI requests and core.dbthreads jobs run."""
    for _ in range(times):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(fn,))
        thread.start()
        thread.join()


def test_counts_from_many_requests_open_no_connection_after_the_first():
    probe = redis.Redis.from_url(settings.CACHES["default"]["LOCATION"])
    key = f"test-{uuid.uuid4().hex}"
    try:
        count(key, 1, 120)  # the process's client connects here
        before = probe.info("stats")["total_connections_received"]
        _in_fresh_contexts(lambda: count(key, 2, 120), 20)
        assert probe.info("stats")["total_connections_received"] == before  # was one connection per context
        assert count(key, 1, 120) == 1 + 20 * 2 + 1
    finally:
        probe.close()


def test_a_forked_child_counts_on_connections_of_its_own():
    key = f"test-{uuid.uuid4().hex}"
    count(key, 1, 120)
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if count(key, 5, 120) == 6 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert count(key, 1, 120) == 7  # the parent's connection still works after the child's


def test_swapped_cache_settings_get_a_client_of_their_own(settings):
    before = shared_cache()
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    assert shared_cache() is not before and type(shared_cache()).__name__ == "LocMemCache"


def test_a_count_is_the_caches_own_key_with_its_expiry():
    key = f"test-{uuid.uuid4().hex}"
    cache = shared_cache()
    client = cache._cache.get_client(write=True)
    assert count(key, 3, 120) == 3
    assert count(key, 4, 120) == 7 and cache.get(key) == 7  # the cache API reads the same counter
    assert 0 < client.ttl(cache.make_key(key)) <= 120  # the first count set the expiry; the second kept it


def test_a_cache_without_redis_counts_through_the_cache_api(settings):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    assert count("k", 2, 60) == 2 and count("k", 5, 60) == 7


def _cascade_case() -> None:
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    assert count_within([(a, 1, 2), (b, 5, 10)], 60) is None
    assert count_within([(a, 1, 2), (b, 5, 10)], 60) is None  # a at 2, b at 10: each at its limit, within
    assert count_within([(a, 1, 2), (b, 5, 10)], 60) == (0, 3)  # a over: b not added to
    assert shared_cache().get(b) == 10
    assert count_within([(b, 1, 100), (a, 0, 5)], 60) is None and shared_cache().get(b) == 11


def test_counters_in_a_cascade_stop_at_the_first_over_its_limit():
    _cascade_case()


def test_a_cascade_without_redis_counts_through_the_cache_api(settings):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    _cascade_case()


def _tally_key() -> str:
    return f"tally-{uuid.uuid4().hex}"


def test_a_tally_counts_far_from_the_limit_without_redis_and_settles_later():
    tally, key = Tally(settle_s=3600), _tally_key()  # settled by hand below
    assert tally.admit([(key, 1, 100)], 60) is False  # a counter not seen yet: counted in Redis
    assert tally.count_within([(key, 1, 100)], 60) is None and shared_cache().get(key) == 1
    assert all(tally.admit([(key, 2, 100)], 60) for _ in range(10))
    assert shared_cache().get(key) == 1  # nothing sent yet
    tally.settle()
    assert shared_cache().get(key) == 21


def test_a_tally_near_its_limit_counts_in_redis_with_its_pending_counts_sent_along():
    tally, key = Tally(settle_s=3600), _tally_key()
    assert tally.count_within([(key, 1, 5)], 60) is None
    admitted = 1 + sum(tally.admit([(key, 1, 5)], 60) for _ in range(10))
    assert admitted == 5 and shared_cache().get(key) == 1  # the 6th would pass 5: Redis must say
    assert tally.count_within([(key, 1, 5)], 60) == (0, 6)  # the 4 pending went with it: refused
    assert shared_cache().get(key) == 6 and tally.admit([(key, 1, 5)], 60) is False


def test_processes_sharing_a_counter_hold_its_limit_to_within_one_settle_of_the_others():
    """Two tallies (two processes) each counting a request per step and settling every 5 steps:
    together they admit no more than the limit plus one settle of the other's counts."""
    key, limit = _tally_key(), 60
    a, b = Tally(settle_s=3600), Tally(settle_s=3600)
    admitted = 0
    for step in range(200):
        for tally in (a, b):
            if tally.admit([(key, 1, limit)], 60) or tally.count_within([(key, 1, limit)], 60) is None:
                admitted += 1
        if step % 5 == 4:
            a.settle()
            b.settle()
    assert limit - 5 <= admitted <= limit + 5
    a.settle()
    b.settle()
    assert shared_cache().get(key) == 400  # every request counted, refused ones too (as count_within counts)


def test_a_tally_with_redis_away_keeps_its_counts_pending_and_sends_them_later(settings, monkeypatch):
    tally, key = Tally(settle_s=3600), _tally_key()
    assert tally.count_within([(key, 1, 100)], 60) is None
    assert tally.admit([(key, 3, 100)], 60)

    def away(*args, **kwargs):
        raise redis.ConnectionError("Redis is away")

    monkeypatch.setattr("core.cache.add_many", away)
    tally.settle()
    assert tally.admit([(key, 3, 100)], 60)  # admitted on its own counts meanwhile
    monkeypatch.undo()
    tally.settle()
    assert shared_cache().get(key) == 7


def _eight_counted_and_a_settle_held(monkeypatch) -> tuple[Tally, str, threading.Event, threading.Thread]:
    """A tally with 8 counted against a limit of 8 (7 of them pending) and a settle of them on
    its way to Redis, held there until the returned event is set."""
    import core.cache

    tally, key = Tally(settle_s=3600), _tally_key()
    assert tally.count_within([(key, 1, 8)], 60) is None
    assert all(tally.admit([(key, 1, 8)], 60) for _ in range(7))
    sending, answer = threading.Event(), threading.Event()
    real = core.cache.add_many

    def slow(amounts, timeout_s):
        sending.set()
        answer.wait(10)
        return real(amounts, timeout_s)

    monkeypatch.setattr("core.cache.add_many", slow)
    settle = threading.Thread(target=tally.settle)
    settle.start()
    assert sending.wait(10)
    return tally, key, answer, settle


def test_a_request_during_a_settles_round_trip_counts_what_is_on_its_way(monkeypatch):
    """The counts a settle is sending are in neither the last shared total nor the pending ones
    until Redis answers: a request admitted meanwhile must still count them (it once passed the
    limit by them, now and then, in the suite)."""
    tally, key, answer, settle = _eight_counted_and_a_settle_held(monkeypatch)
    assert tally.admit([(key, 1, 8)], 60) is False  # the 9th: over 8, with 7 of them on their way
    answer.set()
    settle.join()
    assert shared_cache().get(key) == 8 and tally.admit([(key, 1, 8)], 60) is False


def test_a_count_in_redis_during_a_settles_round_trip_waits_for_it(monkeypatch):
    """Near the limit a request is counted in Redis; the counts a settle is sending may not be
    there yet, so that count waits for the settle's answer instead of reading a total without them."""
    tally, key, answer, settle = _eight_counted_and_a_settle_held(monkeypatch)
    got = []
    counting = threading.Thread(target=lambda: got.append(tally.count_within([(key, 1, 8)], 60)))
    counting.start()
    counting.join(0.3)
    assert counting.is_alive()  # waiting for the settle (counted now, Redis would say 2 of 8)
    answer.set()
    settle.join()
    counting.join(10)
    assert got == [(0, 9)] and shared_cache().get(key) == 9  # the 9th, over 8: refused


def test_a_tally_settles_in_the_background():
    tally, key = Tally(settle_s=0.01), _tally_key()
    tally.count_within([(key, 1, 100)], 60)
    assert tally.admit([(key, 4, 100)], 60)
    deadline = time.monotonic() + 5
    while shared_cache().get(key) != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared_cache().get(key) == 5


def test_a_forked_child_forgets_its_parents_pending_counts():
    tally, key = Tally(settle_s=3600), _tally_key()
    tally.count_within([(key, 1, 100)], 60)
    assert tally.admit([(key, 5, 100)], 60)
    pid = os.fork()
    if pid == 0:
        try:
            tally.settle()  # nothing of the parent's to send
            os._exit(0 if shared_cache().get(key) == 1 and tally.admit([(key, 1, 100)], 60) is False else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tally.settle()
    assert shared_cache().get(key) == 6
