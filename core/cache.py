"""The cache for counters every request touches (rate limits, sign-in and refusal throttles): one
client per process.

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


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs) -> None:
    """A test that swaps CACHES gets a client for the new ones (as Django's own handler does)."""
    global _shared
    if setting == "CACHES":
        with _lock:
            _shared = None
