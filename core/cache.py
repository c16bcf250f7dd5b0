"""The cache for counters every request touches (rate limits, sign-in and refusal throttles): one
client per process, and `count`, a counter's add in one round trip.

Django keeps its cache objects per async context, and a request under ASGI runs in a context of
its own (so does each job of core.dbthreads, which runs in a copy of the request's context): each
request got a new RedisCache, hence a new connection pool, hence a TCP connect and a health
check to Redis before its first count (measured: 0.99 connections a signed ingest request). One
client per process keeps its connections instead. redis-py's pool is thread-safe and starts anew
in a forked child (its pid check), so threads and Celery's prefork children may share this one.
"""

from __future__ import annotations

import threading

from django.core.cache import caches
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.redis import RedisCache
from django.core.signals import setting_changed
from django.dispatch import receiver

_lock = threading.Lock()
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
    On Redis one round trip (SET NX EX, INCRBY, pipelined); Django's add and incr take three (its
    incr checks EXISTS first). The key is the cache's own (its prefix and version), so the cache
    API reads the same counter."""
    cache = shared_cache()
    if not isinstance(cache, RedisCache):
        cache.add(key, 0, timeout=timeout_s)
        return cache.incr(key, amount)
    full = cache.make_and_validate_key(key)
    pipe = cache._cache.get_client(full, write=True).pipeline(transaction=False)
    pipe.set(full, 0, ex=timeout_s, nx=True)
    pipe.incrby(full, amount)
    return int(pipe.execute()[1])


# Counters in order, each added to only while every one before it stayed within its limit (a
# request refused by one budget spends none of the next): one round trip for a serving request's
# three budgets, where three sequential counts kept its admission waiting on Redis three times.
_CASCADE = """
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
    redis.call('SET', key, 0, 'EX', ttl, 'NX')
    local total = redis.call('INCRBY', key, tonumber(ARGV[2 * i]))
    if total > tonumber(ARGV[2 * i + 1]) then
        return {i, total}
    end
end
return {0, 0}
"""


def count_within(counters: list[tuple[str, int, int]], timeout_s: int) -> tuple[int, int] | None:
    """Adds each (key, amount, limit) in order, stopping at the first whose new total passes its
    limit: (that counter's index, its total), or None when every one stayed within. On Redis one
    round trip (a script: atomic); elsewhere the cache API, counter by counter."""
    cache = shared_cache()
    if not isinstance(cache, RedisCache):
        for i, (key, amount, limit) in enumerate(counters):
            cache.add(key, 0, timeout=timeout_s)
            total = cache.incr(key, amount)
            if total > limit:
                return i, total
        return None
    keys = [cache.make_and_validate_key(key) for key, _, _ in counters]
    args = [timeout_s] + [v for _, amount, limit in counters for v in (amount, limit)]
    over, total = cache._cache.get_client(keys[0], write=True).eval(_CASCADE, len(keys), *keys, *args)
    return (int(over) - 1, int(total)) if over else None


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs) -> None:
    """A test that swaps CACHES gets a client for the new ones (as Django's own handler does)."""
    global _shared
    if setting == "CACHES":
        with _lock:
            _shared = None
