"""core.dbthreads: jobs in threads that keep their database connection."""

from __future__ import annotations

import pytest
from django.db import connection

from core import dbthreads

pytestmark = pytest.mark.django_db(transaction=True)


def _backend() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


def test_a_thread_keeps_its_connection_and_replaces_a_dead_one():
    try:
        first = dbthreads.run("test", 1, _backend)
        assert dbthreads.run("test", 1, _backend) == first  # no new connection for the second job
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [first])
        again = dbthreads.run("test", 1, _backend)  # the health check finds it dead: a new one
        assert again != first
    finally:
        dbthreads.close_all()


def test_a_job_error_is_raised_to_the_caller_and_the_thread_goes_on():
    def fail() -> None:
        raise ValueError("the job's own error")

    try:
        with pytest.raises(ValueError, match="the job's own error"):
            dbthreads.run("test", 1, fail)
        assert dbthreads.run("test", 1, _backend) > 0
    finally:
        dbthreads.close_all()


def test_a_job_run_from_one_of_the_pools_threads_runs_in_place():
    import threading

    try:
        outer, inner = dbthreads.run("test", 1, lambda: (threading.get_ident(),
                                                         dbthreads.run("test", 1, threading.get_ident)))
        assert outer == inner  # a pool of one thread would deadlock if it queued the inner job
    finally:
        dbthreads.close_all()


def test_arun_awaits_the_job_with_the_callers_context():
    import asyncio
    import contextvars

    seen = contextvars.ContextVar("seen", default="unset")

    async def main() -> tuple[str, int]:
        seen.set("the caller's")
        return await dbthreads.arun("test", 1, lambda: (seen.get(), _backend()))

    try:
        value, backend = asyncio.run(main())
        assert value == "the caller's" and backend == dbthreads.run("test", 1, _backend)
        assert dbthreads.run("test", 1, seen.get) == "unset"  # the job's context did not stay on the thread
    finally:
        dbthreads.close_all()
