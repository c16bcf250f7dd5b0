"""The serving process's threads outside Django's request cycle (the recorder, the key look-ups)
keep their PostgreSQL connection between calls, and replace one that broke (core/db.py).

Real PostgreSQL: the connection is broken by terminating its backend, as a database restart does.
"""

from __future__ import annotations

import threading

import pytest
from django.db import InterfaceError, OperationalError, connection

from core.db import keep_connections


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _in_a_thread(work) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            work(out)
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            out["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert "error" not in out, out["error"]
    return out


@pytest.mark.django_db(transaction=True)
def test_a_thread_keeps_its_connection_between_calls():
    def work(out: dict) -> None:
        pids = []
        for _ in range(3):
            keep_connections()  # where close_old_connections() closed it (CONN_MAX_AGE 0)
            pids.append(_backend_pid())
        out["pids"] = pids

    pids = _in_a_thread(work)["pids"]
    assert len(set(pids)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_broken_connection_is_replaced_by_the_next_call():
    def work(out: dict) -> None:
        keep_connections()
        before = _backend_pid()
        killer = threading.Thread(target=_terminate, args=(before,))
        killer.start()
        killer.join(30)
        with pytest.raises((OperationalError, InterfaceError)):
            _backend_pid()
        keep_connections()
        out["pids"] = (before, _backend_pid())

    before, after = _in_a_thread(work)["pids"]
    assert before != after


def _terminate(pid: int) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cursor.fetchone()[0] is True
    finally:
        connection.close()
