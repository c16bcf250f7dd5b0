"""The cache for counters every request touches (rate limits, sign-in and refusal throttles): one
client per process, `count`, a counter's add in one round trip, and `Tally`, counters kept in the
process and settled with Redis in the background, for a path that must not wait on Redis.

Django keeps its cache objects per async context, and a request under ASGI runs in a context of
its own (so does each job of core.dbthreads, which runs in a copy of the request's context): each
request got a new RedisCache, hence a new connection pool, hence a TCP connect and a health
check to Redis before its first count (measured: 0.99 connections a signed ingest request). One
client per process keeps its connections instead. redis-py's pool is thread-safe and starts anew
in a forked child (its pid check), so threads and Celery's prefork children may share this one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

from django.core.cache import caches
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.redis import RedisCache
from django.core.signals import setting_changed
from django.dispatch import receiver

log = logging.getLogger(__name__)
_lock = threading.Lock()
_tallies: weakref.WeakSet[Tally] = weakref.WeakSet()
_shared: BaseCache | None = None


def shared_cache() -> BaseCache:
    """The process's client for the `default` cache (settings.CACHES), made on first use."""
    global _shared
    cache = _shared
    if cache is None:
        with _lock:
            if _shared is None:
                _shared = caches.create_connection("default")
            cache = _shared
    return cache


def count(key: str, amount: int, timeout_s: int) -> int:
    """Adds `amount` to counter `key` (created at 0, expiring after `timeout_s`); the new total.
    On Redis one round trip (SET NX EX, INCRBY, pipelined: `add_many`); Django's add and incr take
    three (its incr checks EXISTS first). The key is the cache's own (its prefix and version), so
    the cache API reads the same counter."""
    return add_many({key: amount}, timeout_s)[key]


# Counters in order, each added to only while every one before it stayed within its limit (a
# request refused by one budget spends none of the next): one round trip for a serving request's
# three budgets, where three sequential counts kept its admission waiting on Redis three times.
# Returns the 1-based index of the counter over its limit (0: none), then the totals of the
# counters added to.
_CASCADE = """
local ttl = tonumber(ARGV[1])
local out = {0}
for i, key in ipairs(KEYS) do
    redis.call('SET', key, 0, 'EX', ttl, 'NX')
    local total = redis.call('INCRBY', key, tonumber(ARGV[2 * i]))
    out[i + 1] = total
    if total > tonumber(ARGV[2 * i + 1]) then
        out[1] = i
        return out
    end
end
return out
"""


def _cascade(counters: list[tuple[str, int, int]], timeout_s: int) -> tuple[int | None, list[int]]:
    """The cascade: (the index of the counter over its limit or None, the totals of those added to)."""
    cache = shared_cache()
    if not isinstance(cache, RedisCache):
        totals = []
        for i, (key, amount, limit) in enumerate(counters):
            cache.add(key, 0, timeout=timeout_s)
            totals.append(cache.incr(key, amount))
            if totals[-1] > limit:
                return i, totals
        return None, totals
    keys = [cache.make_and_validate_key(key) for key, _, _ in counters]
    args = [timeout_s] + [v for _, amount, limit in counters for v in (amount, limit)]
    over, *totals = cache._cache.get_client(keys[0], write=True).eval(_CASCADE, len(keys), *keys, *args)
    return (int(over) - 1 if over else None), [int(t) for t in totals]


def count_within(counters: list[tuple[str, int, int]], timeout_s: int) -> tuple[int, int] | None:
    """Adds each (key, amount, limit) in order, stopping at the first whose new total passes its
    limit: (that counter's index, its total), or None when every one stayed within. On Redis one
    round trip (a script: atomic); elsewhere the cache API, counter by counter."""
    over, totals = _cascade(counters, timeout_s)
    return None if over is None else (over, totals[over])


def add_many(amounts: dict[str, int], timeout_s: int) -> dict[str, int]:
    """Adds each amount (0 reads) to its counter, created at 0 with the expiry: the new totals, in
    one round trip on Redis."""
    cache = shared_cache()
    if not isinstance(cache, RedisCache):
        totals = {}
        for key, amount in amounts.items():
            cache.add(key, 0, timeout=timeout_s)
            totals[key] = cache.incr(key, amount)
        return totals
    keys = {key: cache.make_and_validate_key(key) for key in amounts}
    pipe = cache._cache.get_client(next(iter(keys.values())), write=True).pipeline(transaction=False)
    for key, amount in amounts.items():
        pipe.set(keys[key], 0, ex=timeout_s, nx=True)
        pipe.incrby(keys[key], amount)
    replies = pipe.execute()
    return {key: int(replies[2 * i + 1]) for i, key in enumerate(amounts)}


@dataclass
class _Counter:
    known: int  # the shared total when last settled
    pending: int = 0  # counted here since, not yet added to the shared total
    sending: int = 0  # being added to it by a settle whose round trip has not come back
    others: int = 0  # the most the other processes added between two settles (their burst)
    used: float = 0.0  # when last counted here (monotonic)


class Tally:
    """Counters counted in this process first and settled with the shared ones (Redis) every
    `settle_s` by a background thread, so a request far from its limits never waits on Redis.

    A request is admitted here when every counter's shared total as last settled, plus what this
    process has counted since, plus its own amount, plus twice the most the other processes added
    between two settles, stays within the limit. Otherwise (a counter not seen yet, or one near its
    limit) it is counted in Redis at once, exactly as `count_within` counts, with this process's
    unsettled counts sent along (after a settle's round trip that is under way, whose counts are
    counted here until Redis has them): near a limit every process counts in the shared store, and the
    limit holds as it does without the tally. Far from it, the other processes' counts reach this
    one within a settle, and the margin covers what they add meanwhile.

    Settling fails quietly while Redis is away (the counts stay pending and are sent later); the
    process goes on admitting by its own counts."""

    def __init__(self, settle_s: float = 0.1):
        self.settle_s = settle_s
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a settle's round trip came back
        self._counters: dict[str, _Counter] = {}
        _tallies.add(self)
        self._timeout_s = 120
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._warned = 0.0

    def admit(self, counters: list[tuple[str, int, int]], timeout_s: int) -> bool:
        """True when the request is within every limit by this process's counts (it is counted,
        to be settled later); False when it must be counted in Redis (`count_within`)."""
        now = time.monotonic()
        with self._lock:
            self._timeout_s = timeout_s
            states = [self._counters.get(key) for key, _, _ in counters]
            if any(c is None or c.known + c.sending + c.pending + amount + 2 * c.others > limit
                   for c, (_, amount, limit) in zip(states, counters, strict=True)):
                return False
            for c, (_, amount, _) in zip(states, counters, strict=True):
                c.pending += amount
                c.used = now
        self._running()
        return True

    def count_within(self, counters: list[tuple[str, int, int]], timeout_s: int) -> tuple[int, int] | None:
        """`count_within` in Redis, with this process's pending counts of the same counters sent
        along (each counter's total is then the shared one): (index, total) of the counter over
        its limit, or None."""
        now = time.monotonic()
        with self._lock:
            # Counts a settle is sending may not have reached Redis yet: the total this reads
            # back would miss them, so wait for that round trip first (it is one, like ours).
            self._settled.wait_for(lambda: not any(self._counters[key].sending for key, _, _ in counters
                                                   if key in self._counters), timeout=5)
            pending = [self._counters[key].pending if key in self._counters else 0 for key, _, _ in counters]
            for key, _, _ in counters:
                if key in self._counters:
                    self._counters[key].pending = 0
        try:
            over, totals = _cascade([(key, amount + p, limit) for (key, amount, limit), p
                                     in zip(counters, pending, strict=True)], timeout_s)
        except BaseException:
            self._restore(counters, pending)
            raise
        with self._lock:
            for (key, _, _), total in zip(counters, totals, strict=False):
                c = self._counters.setdefault(key, _Counter(known=total))
                c.known, c.used = max(c.known, total), now  # what was counted here meanwhile stays pending
        self._restore(counters[len(totals):], pending[len(totals):])  # not added to: still pending
        self._running()
        return None if over is None else (over, totals[over])

    def _restore(self, counters: list[tuple[str, int, int]], pending: list[int]) -> None:
        with self._lock:
            for (key, _, _), p in zip(counters, pending, strict=True):
                if p:
                    self._counters.setdefault(key, _Counter(known=0)).pending += p

    def settle(self) -> None:
        """Sends the pending counts and reads back the shared totals of the counters in use; drops
        the counters unused for longer than their expiry."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, c in self._counters.items()
                        if not c.pending and not c.sending and now - c.used > self._timeout_s]:
                del self._counters[key]
            sent = {key: c.pending for key, c in self._counters.items()}
            timeout_s = self._timeout_s
            for c in self._counters.values():
                # On its way to Redis: still counted by `admit` until the new total is known (a
                # request admitted during the round trip would otherwise miss it).
                c.sending += c.pending
                c.pending = 0
        if not sent:
            return
        try:
            totals = add_many(sent, timeout_s)
        except Exception:
            with self._lock:
                for key, p in sent.items():
                    c = self._counters.setdefault(key, _Counter(known=0))
                    c.sending, c.pending = max(c.sending - p, 0), c.pending + p
                self._settled.notify_all()
            if now - self._warned > 60:
                self._warned = now
                log.warning("rate counters not settled: the shared cache is unreachable", exc_info=True)
            return
        with self._lock:
            for key, total in totals.items():
                c = self._counters.setdefault(key, _Counter(known=0))
                c.sending = max(c.sending - sent[key], 0)
                c.others = max(c.others, total - c.known - sent[key])
                # A window's counter only grows: a total read before a `count_within` that ran
                # meanwhile (and set `known` to its own, later total) must not set it back.
                c.known = max(c.known, total)
            self._settled.notify_all()

    def forget(self) -> None:
        """Drops every counter (pending counts included): a swapped cache, a forked child."""
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._counters = {}

    def _running(self) -> None:
        if self._pid == os.getpid() and self._thread is not None:
            return
        with self._lock:
            if self._pid != os.getpid() or self._thread is None:
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="flywheel-tally", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(self.settle_s)
            self.settle()


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs) -> None:
    """A test that swaps CACHES gets a client for the new ones (as Django's own handler does)."""
    global _shared
    if setting == "CACHES":
        with _lock:
            _shared = None
        for tally in list(_tallies):
            tally.forget()


def _forked() -> None:
    """A forked child counts afresh: its parent's pending counts are the parent's to send, and a
    lock a parent's thread held would never be released here."""
    for tally in list(_tallies):
        tally.forget()


os.register_at_fork(after_in_child=_forked)
