"""Threads that keep their database connection between jobs, for the ingest endpoint under ASGI.

Django's ASGI handler runs each request's sync code in a thread of its own, so with
CONN_MAX_AGE 0 every request opens a connection (a fork and a SCRAM exchange on the server, a
PBKDF2 on ours: milliseconds of CPU on both sides, more than a batch of 100 events costs to
store). `run(fn)` runs `fn` in one of `size` long-lived threads instead; each thread's Django
connection outlives the job and is checked as Django checks a persistent one between requests
(`close_if_unusable_or_obsolete`: a failed health check, an error state or an age over
`max_age_s` closes it, and the next query reconnects). A job's transaction is its own: it
commits or rolls back inside `fn`, before `run` returns; a thread never keeps one open.

`arun` is the same from async code (webapp/asgi.py runs the ingest endpoint's whole middleware
chain and view this way: one thread hop a request), and `run` called on one of the pool's own
threads runs `fn` there.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from django.db import connections

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_local = threading.local()  # .pool: the name of the pool whose thread this is


def run(name: str, size: int, fn: Callable[[], T], max_age_s: int = 300) -> T:
    """`fn()` in pool `name`'s threads (created on first use, `size` of them); its result or
    its exception, raised here. On one of that pool's threads already, `fn()` runs in place."""
    if getattr(_local, "pool", None) == name:
        return fn()
    return _submit(name, size, fn, max_age_s).result()


async def arun(name: str, size: int, fn: Callable[[], T], max_age_s: int = 300) -> T:
    """`run` for async code: awaits `fn()` on pool `name`'s threads without blocking the loop."""
    return await asyncio.wrap_future(_submit(name, size, fn, max_age_s))


def _submit(name: str, size: int, fn: Callable[[], T], max_age_s: int) -> Future[T]:
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(size, thread_name_prefix=f"db-{name}")
    # The caller's context variables go with the job (as sync_to_async does), not the thread's last ones.
    return pool.submit(contextvars.copy_context().run, _job, name, fn, max_age_s)


def _job(name: str, fn: Callable[[], T], max_age_s: int) -> T:
    _local.pool = name
    for alias in connections:
        conn = connections[alias]
        if conn.settings_dict.get("CONN_MAX_AGE") != max_age_s:
            # A copy for this thread's wrapper alone (set before it first connects, which reads
            # it): the site's setting stays what it is for every other thread.
            conn.settings_dict = {**conn.settings_dict, "CONN_MAX_AGE": max_age_s}
        conn.close_if_unusable_or_obsolete()
    try:
        return fn()
    finally:
        for conn in connections.all(initialized_only=True):
            if conn.in_atomic_block or conn.needs_rollback:
                conn.close()  # never true after a job that used atomic(); a last guard all the same


def close_all() -> None:
    """Ends every pool's threads, closing their connections (tests, before the database goes)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        size = pool._max_workers
        # Each thread closes its own connections (Django refuses to close another thread's): the
        # barrier holds every thread until each has taken one of the `size` jobs.
        barrier = threading.Barrier(size)
        for _ in range(size):
            pool.submit(_close_own, barrier)
        pool.shutdown(wait=True)


def _close_own(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=10)
    finally:
        connections.close_all()
