"""Helpers to run the project's own processes (web server, worker, serving) on the test database."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SESSION_KEY_PREFIX = f"test-{os.getpid()}-{int(time.time())}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            "CACHE_KEY_PREFIX": SESSION_KEY_PREFIX, **extra}


def wait_http(url: str, proc, seconds: float = 90) -> None:
    """Waits until `url` answers 200; raises if `proc` exits first or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{url} did not answer within {seconds} s")
