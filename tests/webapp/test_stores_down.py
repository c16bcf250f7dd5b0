"""Stores down: the real web server (uvicorn), a real Celery worker with beat, on a PostgreSQL and a
Redis of their own that each test stops and starts again.

- PostgreSQL stopped: ingest answers 503 with Retry-After and a JSON body (webhook and bearer),
  the dashboard a 503 page, a task retries with backoff; when it is back all of it resumes.
- Redis stopped: ingest stores and acknowledges, the dashboard renders, sign-in works; when it is
  back live pushes resume and the outbox's waiting hand-off is delivered by beat.

    .venv/bin/python -m pytest tests/webapp/test_stores_down.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from websockets.exceptions import InvalidStatus

from tests.factories import feedback, sign, trajectory
from tests.processes import (
    ROOT,
    OwnPostgres,
    database_url_of,
    free_port,
    subprocess_env,
    wait_http,
    wait_until,
)

# The suite's test database is only the source of the copy the stack runs on (the tests talk to
# the stack over HTTP and read its own database with psycopg).
pytestmark = pytest.mark.django_db

# A request that meets a store which is away is answered within this (a hang fails the test).
BOUND_S = 20


@dataclass
class Stack:
    own: OwnPostgres
    pg_url: str
    redis_url: str
    web: str
    web_proc: subprocess.Popen
    worker_proc: subprocess.Popen
    worker_log: Path
    slug: str
    api_key: str
    webhook_secret: str
    session: str
    username: str
    password: str

    def post_events(self, events: list[dict], *, bearer: bool = False, msg_id: str | None = None) -> httpx.Response:
        body = json.dumps({"events": events})
        if bearer:
            headers = {"authorization": f"Bearer {self.api_key}"}
        else:
            headers = {**sign(self.webhook_secret, body, msg_id=msg_id), "flywheel-project": self.slug}
        return httpx.post(f"{self.web}/api/v1/events", content=body,
                          headers={**headers, "content-type": "application/json"}, timeout=BOUND_S)

    def page(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.web}{path}", cookies={"sessionid": self.session}, timeout=BOUND_S)

    def sql(self, query: str, params: tuple = ()) -> list[tuple]:
        with psycopg.connect(self.pg_url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def pg_down(self) -> None:
        self.own.down()

    def pg_up(self) -> None:
        self.own.up(undurable=True)

    def redis_down(self) -> None:
        self.own.redis_down()

    def redis_up(self) -> None:
        assert self.own.redis_up() == self.redis_url  # the same port: clients reconnect by themselves

    def worker_lines(self, needle: str) -> list[str]:
        return _lines(self.worker_log, needle)


def _lines(log: Path, needle: str) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if needle in line]


def _seed() -> dict[str, Any]:
    """A project, a staff user (a viewer of it) with a session and beat's outbox entry (every second), committed in
    the suite's test database to be copied; the caller deletes them again."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from feedback.services import membership_set, project_create

    slug = f"stores-{uuid.uuid4().hex[:6]}"
    creds = project_create("Stores down", slug)
    password = "stores-password-1"
    user = get_user_model().objects.create_user(f"dana-{slug}", password=password, is_staff=True)
    membership_set(creds.project, user, "viewer")  # the dashboard shows a project to its members only
    client = Client()
    client.force_login(user)
    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    entry = PeriodicTask.objects.create(name=f"outbox {slug}", task="core.tasks.outbox_deliver", interval=every)
    return {"creds": creds, "user": user, "password": password, "session": client.cookies["sessionid"].value,
            "beat": (entry, every)}


def _unseed(seed: dict[str, Any]) -> None:
    from django.contrib.sessions.models import Session

    Session.objects.filter(session_key=seed["session"]).delete()
    entry, every = seed["beat"]
    entry.delete()
    every.delete()
    seed["user"].delete()
    seed["creds"].project.delete()


def _pg_dump_for(source: str) -> str:
    """The pg_dump of the source server's major version where the machine has one (Debian's
    /usr/lib/postgresql/<major>/bin): a newer pg_dump's output for an older server (CI's second pass
    runs on the machine's PostgreSQL) does not load into the embedded server; else the embedded one."""
    from django.db import connection

    from core import embedded

    own = Path(f"/usr/lib/postgresql/{connection.pg_version // 10000}/bin/pg_dump")
    return str(own) if own.exists() else embedded._pg_bin("pg_dump")


def _copy_database(source: str, target: str) -> None:
    from core import embedded

    dump = subprocess.run([_pg_dump_for(source), "--no-owner", "--no-privileges", "-d", source],
                          capture_output=True, timeout=120)
    assert dump.returncode == 0, dump.stderr.decode(errors="replace")
    load = subprocess.run([embedded._pg_bin("psql"), "-q", "-1", "-v", "ON_ERROR_STOP=1", "-d", target],
                          input=dump.stdout, capture_output=True, timeout=120)
    assert load.returncode == 0, load.stderr.decode(errors="replace")


def _start(cmd: list[str], env: dict[str, str], cleanup: contextlib.ExitStack, **kwargs: Any) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **kwargs)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    cleanup.callback(stop)
    return proc


@pytest.fixture(scope="module")
def stack(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Stack]:
    from django.db import connection

    # Under var/ rather than pytest's temporary folder: PostgreSQL runs as a user of its own when
    # the suite runs as root, and another pytest session closes pytest's folder to other users.
    var = ROOT / "var" / f"test-stores-{os.getpid()}"
    own = OwnPostgres(var)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, var, ignore_errors=True)
        cleanup.callback(own.redis_down)
        cleanup.callback(own.down)
        pg_url = own.up(undurable=True)
        redis_url = own.redis_up()
        with django_db_blocker.unblock():
            seed = _seed()
            try:
                _copy_database(database_url_of(connection.settings_dict), pg_url)
            finally:
                _unseed(seed)
        # The worker keeps its connections (health-checked); the web process opens one per request.
        env = subprocess_env(DATABASE_URL=pg_url, REDIS_URL=redis_url, DB_CONNECT_TIMEOUT_S="3")
        port = free_port()
        web_proc = _start([sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1",
                           "--port", str(port), "--log-level", "warning"], env, cleanup)
        worker_log = tmp_path_factory.mktemp("stores-logs") / "worker.log"
        log = cleanup.enter_context(open(worker_log, "wb"))
        worker_proc = _start([sys.executable, "-m", "celery", "-A", "webapp", "worker", "-B", "-l", "info",
                              "--pool", "solo", "-Q", "celery,ingest", "-n", f"stores-{uuid.uuid4().hex[:6]}@%h",
                              "-s", str(worker_log.parent / "beat-schedule")],
                             {**env, "DB_CONN_MAX_AGE": "600"}, cleanup, stdout=log, stderr=subprocess.STDOUT)
        web = f"http://127.0.0.1:{port}"
        wait_http(web + "/healthz", web_proc, 300)
        # Beat reads its schedule from the database once, as it starts: a test that stops PostgreSQL
        # before then leaves beat dead for the module. Tests start once beat has run a round.
        wait_until(lambda: _lines(worker_log, "core.tasks.outbox_deliver") and _lines(worker_log, "succeeded"),
                   timeout=300, what="the worker and its beat to start")
        creds = seed["creds"]
        yield Stack(own=own, pg_url=pg_url, redis_url=redis_url, web=web, web_proc=web_proc,
                    worker_proc=worker_proc, worker_log=worker_log, slug=creds.project.slug, api_key=creds.api_key,
                    webhook_secret=creds.webhook_secret, session=seed["session"], username=seed["user"].username,
                    password=seed["password"])


@pytest.fixture
def worker(stack: Stack) -> Stack:
    """The stack once its worker (and beat) answer: beat has sent an outbox round and it ran."""
    wait_until(lambda: stack.worker_lines("core.tasks.outbox_deliver") and stack.worker_lines("succeeded"),
               timeout=300, what="the worker and its beat to start")
    assert stack.worker_proc.poll() is None
    return stack


# --- PostgreSQL stopped -----------------------------------------------------------------------


def test_with_postgres_stopped_ingest_answers_503_with_retry_after_and_stores_when_it_is_back(stack):
    events = [trajectory("t-pg"), feedback("fb-pg", "t-pg")]
    stack.pg_down()
    try:
        signed = stack.post_events(events, msg_id="msg-pg-down")
        bearer = stack.post_events(events, bearer=True)
        for response in (signed, bearer):
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "5"
            error = response.json()["error"]
            assert error["code"] == "unavailable" and "database is unavailable" in error["message"]
            assert "retry" in error["fix"].lower() and error["retry_after"] == 5
        health = httpx.get(f"{stack.web}/healthz", timeout=BOUND_S)
        assert health.status_code == 503 and health.json()["error"]["code"] == "unavailable"
    finally:
        stack.pg_up()
    # Back: the same delivery (same webhook-id) lands on a fresh connection, exactly once.
    again = stack.post_events(events, msg_id="msg-pg-down")
    assert again.status_code == 202 and again.json()["accepted"] == 2, again.text
    assert stack.post_events(events, bearer=True).json()["duplicate"] == 2
    assert stack.sql("SELECT count(*) FROM feedback_feedbackevent WHERE event_id = 'fb-pg' "
                     "AND trajectory_id IS NOT NULL") == [(1,)]


def test_the_client_rides_out_a_postgres_restart_and_its_delivery_lands_once(stack):
    from concurrent.futures import ThreadPoolExecutor

    from feedback.client import FlywheelClient

    statuses: list[int] = []
    http = httpx.Client(timeout=BOUND_S, event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    client = FlywheelClient(stack.web, stack.webhook_secret, project=stack.slug, max_retries=6, http=http)
    stack.pg_down()
    try:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(client.send, [trajectory("t-client"), feedback("fb-client", "t-client")])
            try:
                wait_until(lambda: 503 in statuses, timeout=BOUND_S, what="the first 503")
            finally:
                stack.pg_up()  # while the client waits the Retry-After
            result = sent.result(timeout=120)
    finally:
        client.close()
    assert statuses[0] == 503 and statuses[-1] == 202 and result.attempts == len(statuses) >= 2
    assert result.accepted == 2
    assert stack.sql("SELECT count(*) FROM feedback_webhookdelivery WHERE webhook_id = %s",
                     (result.webhook_id,)) == [(1,)]


def test_with_postgres_stopped_the_dashboard_shows_an_error_page_and_recovers(stack):
    assert stack.page(f"/p/{stack.slug}/").status_code == 200
    stack.pg_down()
    try:
        for path in ("/", f"/p/{stack.slug}/", f"/p/{stack.slug}/runs/"):
            page = stack.page(path)
            assert page.status_code == 503, (path, page.text[:500])
            assert page.headers["Retry-After"] == "5"
            assert "The database is unavailable" in page.text and "Traceback" not in page.text
        api = httpx.get(f"{stack.web}/api/v1/trajectories", headers={"authorization": f"Bearer {stack.api_key}"},
                        timeout=BOUND_S)
        assert api.status_code == 503 and api.json()["error"]["code"] == "unavailable"
        # The live socket cannot read its session: refused (403), not failed (500); the browser retries.
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(_socket(stack))
        assert refused.value.response.status_code == 403
    finally:
        stack.pg_up()
    page = stack.page(f"/p/{stack.slug}/")
    assert page.status_code == 200 and stack.slug in page.text  # the session outlived the outage


def test_with_postgres_stopped_a_task_retries_with_backoff_and_completes_when_it_is_back(worker):
    stack = worker
    assert stack.post_events([feedback("fb-orphan", "t-orphan"), trajectory("t-orphan")]).status_code == 202
    stack.sql("UPDATE feedback_feedbackevent SET trajectory_id = NULL WHERE event_id = 'fb-orphan'")
    from kombu import Connection

    from webapp.celery import app

    stack.pg_down()
    try:
        broker = stack.redis_url + "/0"
        with Connection(broker, transport_options=app.conf.broker_transport_options) as conn:
            task = app.send_task("feedback.tasks.feedback_link_orphans_all", connection=conn, queue="ingest")
        retried = f"[{task.id}] retry: Retry in "
        retries = wait_until(lambda: len(stack.worker_lines(retried)) >= 3 and stack.worker_lines(retried),
                             timeout=120, what="three retries of the task")
        assert all("OperationalError" in line for line in retries)
        # Exponential backoff, jittered: the n-th retry waits at most 2**n seconds (then 300 s at most).
        countdowns = [int(re.search(r"Retry in (\d+)s", line).group(1)) for line in retries]
        assert all(c <= 2 ** n for n, c in enumerate(countdowns)), countdowns
        assert stack.worker_proc.poll() is None  # retrying, not crashing
        assert stack.worker_lines(f"[{task.id}] succeeded") == []
        # Beat's own entries are not retried (the next tick sends them again): no pile of copies.
        wait_until(lambda: stack.worker_lines("core.tasks.outbox_deliver (beat entry"), timeout=60,
                   what="a beat entry left to its next tick")
        assert not [line for line in stack.worker_lines("Task core.tasks.outbox_deliver[") if "retry:" in line]
    finally:
        stack.pg_up()
    wait_until(lambda: stack.sql("SELECT trajectory_id FROM feedback_feedbackevent "
                                 "WHERE event_id = 'fb-orphan'") != [(None,)], timeout=120,
               what="the retried task to link the feedback")
    wait_until(lambda: stack.worker_lines(f"[{task.id}] succeeded"), timeout=30, what="the task's success")
    assert not stack.worker_lines(f"[{task.id}] raised unexpected")
    assert stack.worker_proc.poll() is None
    # Beat lived through it too: it goes on sending the outbox round, which succeeds again.
    mark = len(stack.worker_lines("Task core.tasks.outbox_deliver"))
    wait_until(lambda: len(stack.worker_lines("Task core.tasks.outbox_deliver")) > mark + 1, timeout=60,
               what="beat's next outbox round")


def _pid_of_postgres(stack: Stack) -> int:
    return int((stack.own.var_dir / "pg" / "postmaster.pid").read_text().split()[0])


def _pid_of_redis(stack: Stack) -> int:
    return int((stack.own.var_dir / "run" / "redis.pid").read_text().strip())


def test_a_postgres_that_hangs_costs_ingest_its_connect_timeout_not_a_hang(stack):
    pid = _pid_of_postgres(stack)
    os.kill(pid, signal.SIGSTOP)  # it accepts connections and never answers them
    try:
        response = stack.post_events([feedback("fb-frozen", "t-frozen")])  # fails the test past BOUND_S
        assert response.status_code == 503 and response.headers["Retry-After"] == "5", response.text
        page = stack.page(f"/p/{stack.slug}/")
        assert page.status_code == 503 and "The database is unavailable" in page.text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stack.post_events([feedback("fb-frozen", "t-frozen")]).json()["accepted"] == 1


# --- Redis stopped ----------------------------------------------------------------------------


def test_with_redis_stopped_ingest_stores_and_acknowledges_and_the_dashboard_renders(stack):
    stack.redis_down()
    try:
        signed = stack.post_events([trajectory("t-redis"), feedback("fb-redis", "t-redis")])
        bearer = stack.post_events([feedback("fb-redis-2", "t-redis", signal="reject")], bearer=True)
        assert signed.status_code == 202 and signed.json()["accepted"] == 2, signed.text
        assert bearer.status_code == 202 and bearer.json()["accepted"] == 1, bearer.text
        assert stack.sql("SELECT count(*) FROM feedback_feedbackevent WHERE trajectory_id IS NOT NULL "
                         "AND event_id IN ('fb-redis', 'fb-redis-2')") == [(2,)]
        for path in ("/", f"/p/{stack.slug}/", f"/p/{stack.slug}/rollouts/"):
            page = stack.page(path)
            assert page.status_code == 200, (path, page.text[:500])
        # Signing in counts failures in Redis; without it, it still signs in (and still refuses).
        assert _sign_in(stack, stack.password).status_code == 302
        assert _sign_in(stack, "wrong-password").status_code == 200
    finally:
        stack.redis_up()


def test_a_redis_that_hangs_costs_ingest_and_the_dashboard_a_bounded_delay(stack):
    pid = _pid_of_redis(stack)
    os.kill(pid, signal.SIGSTOP)  # connections open, commands never answered
    try:
        response = stack.post_events([feedback("fb-hung-redis", "t-hung")])  # fails the test past BOUND_S
        assert response.status_code == 202 and response.json()["accepted"] == 1, response.text
        assert stack.page(f"/p/{stack.slug}/").status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stack.post_events([feedback("fb-hung-redis-2", "t-hung")]).json()["accepted"] == 1


def _sign_in(stack: Stack, password: str) -> httpx.Response:
    with httpx.Client(base_url=stack.web, timeout=BOUND_S) as client:
        form = client.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        return client.post("/accounts/login/", data={"username": stack.username, "password": password,
                                                     "csrfmiddlewaretoken": token})


async def _socket(stack: Stack):
    import websockets

    url = stack.web.replace("http://", "ws://") + f"/ws/projects/{stack.slug}/"
    return await websockets.connect(url, additional_headers={"cookie": f"sessionid={stack.session}",
                                                             "origin": stack.web}, open_timeout=BOUND_S)


async def _next_push(ws, timeout: float = 30) -> dict:
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if message.get("type") == "ingest":
            return message


async def _post(stack: Stack, event_id: str) -> None:
    response = await asyncio.to_thread(stack.post_events, [feedback(event_id, "t-live")])
    assert response.status_code == 202 and response.json()["accepted"] == 1, response.text


async def _pushes_across_an_outage(stack: Stack) -> list[str]:
    from websockets.exceptions import ConnectionClosed

    seen = []
    ws = await _socket(stack)
    await _post(stack, "fb-live-1")
    seen.append((await _next_push(ws))["type"])
    stack.redis_down()
    try:
        # The write is acknowledged without the channel layer; the open socket is closed (the
        # browser then reconnects with backoff) rather than left open and silent.
        await _post(stack, "fb-live-2")
        with pytest.raises(ConnectionClosed) as closed:
            await _next_push(ws, BOUND_S)
        seen.append(f"closed {closed.value.rcvd.code}")
        # A new socket cannot join its group yet: closed with "try again later".
        refused = await _socket(stack)
        with pytest.raises(ConnectionClosed) as closed:
            await _next_push(refused, BOUND_S)
        seen.append(f"refused {closed.value.rcvd.code}")
    finally:
        stack.redis_up()
    ws = await _socket(stack)  # what the browser's reconnect does
    await _post(stack, "fb-live-3")
    seen.append((await _next_push(ws))["type"])
    await ws.close()
    return seen


def test_with_redis_stopped_pushes_pause_and_resume_when_it_is_back(stack):
    assert asyncio.run(_pushes_across_an_outage(stack)) == ["ingest", "closed 1013", "refused 1013", "ingest"]
    assert stack.sql("SELECT count(*) FROM feedback_feedbackevent WHERE event_id LIKE 'fb-live-%%'") == [(3,)]


def test_with_redis_stopped_a_hand_off_waits_in_the_outbox_and_beat_delivers_it_when_it_is_back(worker):
    stack = worker
    assert stack.post_events([feedback("fb-later", "t-later"), trajectory("t-later")]).status_code == 202
    stack.sql("UPDATE feedback_feedbackevent SET trajectory_id = NULL WHERE event_id = 'fb-later'")
    stack.redis_down()
    try:
        # What a commit leaves when the broker is away at that moment (the hand-off itself:
        # tests/training/runs/test_self_healing.py): a pending row, older than the delivery grace.
        stack.sql("INSERT INTO core_outboxmessage (task, args, kwargs, created_at, attempts, last_error) "
                  "VALUES ('feedback.tasks.feedback_link_orphans_all', '[]', '{}', now() - interval '1 minute', "
                  "1, 'ConnectionError: Redis is away')")
        # Beat ticks on while Redis is away: once it has tried two rounds more (it sends one after
        # the other), a delivery would have happened by now.
        rounds = len(stack.worker_lines("Sending due task outbox"))
        wait_until(lambda: len(stack.worker_lines("Sending due task outbox")) >= rounds + 2, timeout=60,
                   what="beat's outbox rounds while Redis is away")
        assert stack.sql("SELECT count(*) FROM core_outboxmessage WHERE sent_at IS NULL") == [(1,)]
    finally:
        stack.redis_up()
    wait_until(lambda: stack.sql("SELECT count(*) FROM core_outboxmessage WHERE sent_at IS NULL") == [(0,)],
               timeout=120, what="beat to deliver the waiting hand-off")
    wait_until(lambda: stack.sql("SELECT trajectory_id FROM feedback_feedbackevent "
                                 "WHERE event_id = 'fb-later'") != [(None,)], timeout=120,
               what="the delivered task to run")
    assert stack.worker_proc.poll() is None and stack.web_proc.poll() is None
