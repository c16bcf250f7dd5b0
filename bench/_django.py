"""A Django set-up on a database of the benchmark's own (created when missing, migrated), on the
embedded PostgreSQL or DATABASE_URL's server, so benchmarks never touch the demo's data."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:  # first: bench/inference.py must not shadow the package
    sys.path.insert(0, str(ROOT))

from core import devsecrets  # noqa: E402 - after the path above

# Benchmarks run with the development secrets (var/dev-secrets.json) unless the environment has its own.
devsecrets.setdefault_environ()


def bench_database_url(name: str) -> str:
    base = os.environ.get("DATABASE_URL")
    if not base:
        from core import embedded

        base = embedded.postgres_url()
    return urlparse(base)._replace(path=f"/{name}").geturl()


def setup_django(name: str, *, fresh: bool = False) -> str:
    """Creates and migrates database `name` (dropped first when `fresh`: a bench whose tables grow
    with every run, measured on a database of the same size each time), points Django at it,
    returns its URL."""
    import psycopg

    url = bench_database_url(name)
    with psycopg.connect(urlparse(url)._replace(path="/postgres").geturl(), autocommit=True) as conn:
        if fresh:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return url
