"""Shared fixtures: users (alice approves and bob views the project `acme`, charlie is a member of
no project), a project with credentials, signed requests, and a real ASGI server on the test
database.

The database is real PostgreSQL (embedded under var/ unless DATABASE_URL is set) and the cache,
broker and channel layer are real Redis (embedded unless REDIS_URL is set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.factories import as_django_headers, member, sign
from tests.processes import (
    ROOT,
    SESSION_KEY_PREFIX,
    OwnPostgres,
    free_port,
    start_celery_worker,
    subprocess_env,
    wait_http,
)
from training.pretrain import PolicyConfig, build_policy, stdlib_corpus


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache_keys():
    """Tests share Redis with a running demo: give this session keys of its own."""
    from django.conf import settings
    from django.test import override_settings

    caches = {name: {**conf, "KEY_PREFIX": SESSION_KEY_PREFIX} for name, conf in settings.CACHES.items()}
    with override_settings(CACHES=caches):
        yield


# Other sessions' open transactions on the test database (the session's Celery worker, servers).
_OTHERS = ("FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
           "AND backend_type = 'client backend' AND state IN ('active', 'idle in transaction', "
           "'idle in transaction (aborted)')")


_SESSION_WORKER: list[tuple[str, subprocess.Popen]] = []  # the session Celery worker (node, process)
_WORKER_QUEUES = ("celery", "ingest", "rewards", "train", "rollouts", "gate")


def _worker_idle(node: str) -> bool:
    """Nothing waits in the worker's queues and the worker answers that it has no task running or
    reserved (a solo worker busy with a task does not answer at all)."""
    from kombu.exceptions import ChannelError

    from webapp.celery import app

    with app.connection_for_read() as conn:
        channel = conn.default_channel
        for queue in _WORKER_QUEUES:
            try:
                if channel.queue_declare(queue, passive=True).message_count:
                    return False
            except ChannelError:  # Redis keeps no empty list: a queue with nothing in it is absent
                pass
    inspect = app.control.inspect(destination=[node], timeout=1.0, limit=1)
    for method in (inspect.active, inspect.reserved):
        reply = method()
        if not reply or any(reply.values()):
            return False
    return True


def _wait_until_idle(node: str, timeout: float) -> None:
    """Two idle readings in a row (a message being handed over is in neither place for a moment)."""
    deadline = time.monotonic() + timeout
    idle = 0
    while idle < 2 and time.monotonic() < deadline:
        try:
            idle = idle + 1 if _worker_idle(node) else 0
        except Exception:  # the broker's state is only a hint here; the database wait follows
            return
        if idle < 2:
            time.sleep(0.1)


@pytest.fixture(autouse=True, scope="session")
def _flush_retried_on_deadlock():
    """A TRUNCATE that PostgreSQL picks as a deadlock's victim is rolled back whole: run it again
    once the other transaction has finished (three tries)."""
    import psycopg
    from django.db.backends.base.operations import BaseDatabaseOperations
    from django.db.utils import OperationalError

    original = BaseDatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        for attempt in range(3):
            try:
                return original(self, sql_list)
            except OperationalError as exc:
                if attempt == 2 or not isinstance(exc.__cause__, psycopg.errors.DeadlockDetected):
                    raise
                time.sleep(1.0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BaseDatabaseOperations, "execute_sql_flush", execute_sql_flush)
        yield


@pytest.fixture(autouse=True)
def _quiet_database_before_flush(request):
    """A transactional test's database is emptied by TRUNCATE after it. A task the test handed to
    the session's Celery worker (the gate a finished run enqueues, say) may still hold row locks
    then, and the TRUNCATE deadlocks with it: seen in full runs, failing that test's teardown and
    the next test's setup. Waiting for open transactions alone was not enough: a task still queued
    starts its transactions after the wait. Before the flush: wait up to 60 s for the session
    worker to have nothing queued, reserved or running, then up to 20 s for other sessions'
    transactions on the test database to end, then end the ones still open. The flush itself is
    retried if it is still picked as a deadlock's victim (`_flush_retried_on_deadlock`)."""
    marker = request.node.get_closest_marker("django_db")
    transactional = bool(marker and marker.kwargs.get("transaction")) or "transactional_db" in request.fixturenames
    if not transactional:
        yield
        return
    request.getfixturevalue("_django_db_helper" if marker else "transactional_db")  # flushed after this fixture
    yield
    from django.db import DatabaseError, connection

    if _SESSION_WORKER and _SESSION_WORKER[0][1].poll() is None:
        _wait_until_idle(_SESSION_WORKER[0][0], timeout=60)
    try:
        with connection.cursor() as cursor:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                cursor.execute(f"SELECT count(*) {_OTHERS}")
                if cursor.fetchone()[0] == 0:
                    return
                time.sleep(0.25)
            cursor.execute(f"SELECT pg_terminate_backend(pid) {_OTHERS}")
    except DatabaseError:
        pass  # the flush says what is wrong, if anything is


@pytest.fixture
def one_rate_window():
    """Rate limits count in fixed one-minute windows (feedback/ratelimit.py): a test that spends a
    budget and then expects the refusal must not straddle a window's end, or the second request
    lands in a fresh window and passes. Starts the test in a window with 20 s or more left."""
    from feedback.ratelimit import WINDOW_S

    left = WINDOW_S - time.time() % WINDOW_S
    if left < 20:
        time.sleep(left + 0.05)


@pytest.fixture
def alice(django_user_model, creds):
    """An approver of acme (and of nothing else)."""
    return member(django_user_model.objects.create_user("alice", password="alice-password-1"), creds.project,
                  "approver")


@pytest.fixture
def bob(django_user_model, creds):
    """A viewer of acme."""
    return member(django_user_model.objects.create_user("bob", password="bob-password-1"), creds.project, "viewer")


@pytest.fixture
def charlie(django_user_model):
    return django_user_model.objects.create_user("charlie", password="charlie-password-1")


@pytest.fixture
def creds(db):
    from feedback.services import project_create

    return project_create("Acme Autocomplete", "acme")


@pytest.fixture
def other_creds(db):
    from feedback.services import project_create

    return project_create("Other Product", "other")


@pytest.fixture
def post_events(client, creds):
    """post_events(events | body, secret=..., project=..., headers=...) -> response (signed)."""

    def post(payload: Any, *, secret: str | None = None, project: str | None = None,
             headers: dict[str, str] | None = None, raw: bytes | None = None):
        body = raw if raw is not None else json.dumps(payload if isinstance(payload, dict) else {"events": payload}).encode()
        signed = headers if headers is not None else sign(secret or creds.webhook_secret, body)
        signed = {**signed, "flywheel-project": project or creds.project.slug}
        return client.generic("POST", "/api/v1/events", body, content_type="application/json",
                              **as_django_headers(signed))

    return post


# --- the project's processes on the test database -------------------------------------------------


@pytest.fixture(scope="session")
def celery_worker_process(django_db_setup):
    """A real Celery worker (a separate process, all queues) on the test database and the test
    Redis databases. Tests that use it must commit their rows: use `transactional_db`."""
    from webapp.celery import app

    app.control.purge()
    node = f"test-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
    proc, log = start_celery_worker(",".join(_WORKER_QUEUES), node, "test-celery-worker.log", subprocess_env())
    _SESSION_WORKER.append((node, proc))
    yield proc
    _SESSION_WORKER.clear()
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def asgi_server(django_db_setup):
    """Base URL of uvicorn serving webapp.asgi on the test database (tests must commit: use
    `transactional_db`)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--workers", "1"],
        cwd=ROOT, env=subprocess_env(),
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", proc, 60)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="session")
def own_postgres(tmp_path_factory: pytest.TempPathFactory):
    """An embedded PostgreSQL of its own (not the suite's server), for tests that stop it or
    check how it starts; stopped at the end of the session."""
    pg = OwnPostgres(tmp_path_factory.mktemp("own-pg"))
    yield pg
    pg.down()
    pg.redis_down()


# --- tiny policies, built once per session (inference and training tests share them) ---------

# Strings that split differently under another pre-tokenizer or normaliser: digits, runs of
# spaces and newlines, tabs, a decomposed accent (NFC folds it), non-ASCII, special tokens.
TRICKY_TEXTS = [
    "x = 12345  # héllo\n\tdef  f(): return 'ü'",
    "e\u0301 <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "   \n\n  indented\r\n\ttab 3.14159e-10 0x1F",
    "import os, sys  # 日本語 🙂",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return stdlib_corpus(max_lines=20_000)


@pytest.fixture(scope="session")
def policies_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("policies")


@pytest.fixture(scope="session")
def dense_dir(policies_root: Path, corpus: list[str]) -> Path:
    return build_policy(policies_root / "dense", PolicyConfig(kind="dense"), corpus)


@pytest.fixture(scope="session")
def moe_dir(policies_root: Path, corpus: list[str]) -> Path:
    return build_policy(policies_root / "moe", PolicyConfig(kind="moe"), corpus)


@pytest.fixture(scope="session", params=["dense", "moe"])
def policy_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")
