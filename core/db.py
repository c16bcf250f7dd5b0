"""Database connections of long-lived threads outside Django's request cycle (the serving
process's recorder and its key look-ups)."""

from __future__ import annotations

from django.db import connections


def keep_connections() -> None:
    """`close_old_connections()` without the age limit: this thread's connections stay open
    between calls, and only one that broke (or was left outside autocommit) is closed, so the next
    query opens a new one; with CONN_HEALTH_CHECKS the next query first checks the kept one.

    With CONN_MAX_AGE 0 (the default) close_old_connections closes every connection on every call:
    in a thread that writes every quarter second, each write opened a PostgreSQL backend with a
    SCRAM handshake, a third of the serving process's CPU."""
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block:  # the caller's transaction (a test's, around an in-process request)
            continue
        conn.close_at = None
        conn.close_if_unusable_or_obsolete()
