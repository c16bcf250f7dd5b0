"""Helpers to run the project's own processes (web server, worker, serving) on the test database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
SESSION_KEY_PREFIX = f"test-{os.getpid()}-{int(time.time())}"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never one this process handed out before: two calls in a
    row can get the same port from the kernel, and the second server to bind it exits at startup."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def database_url_of(settings_dict: dict) -> str:
    host = settings_dict["HOST"] or ""
    user = settings_dict["USER"]
    password = f":{settings_dict['PASSWORD']}" if settings_dict["PASSWORD"] else ""
    if host.startswith("/"):
        return f"postgresql://{user}{password}@/{settings_dict['NAME']}?host={host}"
    port = f":{settings_dict['PORT']}" if settings_dict["PORT"] else ""
    return f"postgresql://{user}{password}@{host}{port}/{settings_dict['NAME']}"


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess (web server, Celery worker, serving) on this session's test
    database and test Redis databases."""
    from django.conf import settings
    from django.db import connection

    return {**os.environ, "DATABASE_URL": database_url_of(connection.settings_dict),
            "REDIS_URL": settings.REDIS_BASE_URL, "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "CACHE_KEY_PREFIX": SESSION_KEY_PREFIX,
            # Tests stand model judges up on loopback, which only an allowed network reaches.
            "FLYWHEEL_JUDGE_ALLOWED_NETWORKS": "127.0.0.0/8", **extra}


T = TypeVar("T")


def wait_until(check: Callable[[], T], *, timeout: float = 60, what: str = "condition", every: float = 0.2) -> T:
    """Polls `check` until it returns something truthy (returned) or `timeout` seconds pass (an
    AssertionError naming `what`). The tests' one poll: wait for the event, never sleep a guess."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def wait_http(url: str, proc, seconds: float = 90, log: Path | None = None) -> None:
    """Waits until `url` answers 200; raises if `proc` exits first or time runs out (with the
    tail of the process's `log`, when it writes one)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            tail = log.read_bytes()[-3000:].decode(errors="replace") if log and log.exists() else ""
            raise RuntimeError(f"the process serving {url} exited with {proc.returncode}" + (f":\n{tail}" if tail else ""))
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{url} did not answer within {seconds} s")


def start_celery_worker(queues: str, node: str, log_name: str, env: dict[str, str],
                        seconds: float = 300) -> tuple[subprocess.Popen, IO[bytes]]:
    """A real Celery worker (solo pool) named `node` (`name@host`, `%h` allowed) on `queues`, its
    output in var/`log_name`: (process, log file) once it answers a ping. Raises, the process
    killed, if it exits first or stays silent for `seconds` (minutes on a busy machine)."""
    from webapp.celery import app

    (ROOT / "var").mkdir(exist_ok=True)
    log = open(ROOT / "var" / log_name, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "webapp", "worker", "-l", "info", "--pool", "solo",
                             "-Q", queues, "-n", node], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    name = node.replace("%h", os.uname().nodename)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the Celery worker {name} exited during start-up; see var/{log_name}")
        return bool(app.control.ping(destination=[name], timeout=0.5))  # the ping's wait is the poll's

    try:
        wait_until(answers, timeout=seconds, every=0, what=f"the Celery worker {name} to answer (var/{log_name})")
    except BaseException:
        proc.kill()
        proc.wait()
        log.close()
        raise
    return proc, log


class OwnPostgres:
    """An embedded PostgreSQL (and, on demand, Redis) of a test's own, under `var_dir`
    (core/embedded.py run as a command with FLYWHEEL_VAR_DIR): stopped and started by the test
    without touching the suite's servers."""

    def __init__(self, var_dir: Path) -> None:
        self.var_dir = var_dir

    def _embedded(self, *args: str, undurable: bool = False) -> str:
        import subprocess
        import sys

        env = {**os.environ, "FLYWHEEL_VAR_DIR": str(self.var_dir)}
        env.pop("FLYWHEEL_TEST_PG_UNDURABLE", None)
        if undurable:
            env["FLYWHEEL_TEST_PG_UNDURABLE"] = "1"
        done = subprocess.run([sys.executable, "-m", "core.embedded", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"core.embedded {' '.join(args)} failed: {done.stderr[-2000:]}")
        return done.stdout

    def up(self, *, undurable: bool = False) -> str:
        """Starts it (or reuses it); returns its DATABASE_URL."""
        out = self._embedded("up", "postgres", undurable=undurable)
        return next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("DATABASE_URL="))

    def down(self) -> None:
        self._embedded("down", "postgres")

    def redis_up(self) -> str:
        """Starts its Redis (on the port it had before, when restarted); returns its REDIS_URL."""
        out = self._embedded("up", "redis")
        return next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("REDIS_URL="))

    def redis_down(self) -> None:
        self._embedded("down", "redis")

    def durable_url(self) -> str:
        """What a durable caller (the demo, a worker) gets: embedded.postgres_url() without the switch."""
        import subprocess
        import sys

        env = {**os.environ, "FLYWHEEL_VAR_DIR": str(self.var_dir)}
        env.pop("FLYWHEEL_TEST_PG_UNDURABLE", None)
        done = subprocess.run([sys.executable, "-c", "from core import embedded; print(embedded.postgres_url())"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=True)
        return done.stdout.strip()

    def settings(self, url: str) -> dict[str, str]:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            return {name: conn.execute(f"SHOW {name}").fetchone()[0]
                    for name in ("fsync", "full_page_writes", "synchronous_commit")}


class InThreadServer:
    """uvicorn serving an ASGI `app` on a thread of this process (its settings and monkeypatches
    apply): `url` while running, `stop()` to end it."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"uvicorn on {self.url} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
