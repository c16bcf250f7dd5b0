"""A Django set-up on a database of the benchmark's own (created when missing, migrated), on the
embedded PostgreSQL or DATABASE_URL's server, so benchmarks never touch the demo's data."""

from __future__ import annotations

import hashlib
import os
import subprocess
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


def _migrations_digest() -> str:
    """What the schema is made from: every app's migration files, their names and bytes."""
    digest = hashlib.sha256()
    for path in sorted(ROOT.glob("*/migrations/*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _admin_url(url: str) -> str:
    return urlparse(url)._replace(path="/postgres").geturl()


def _template(admin) -> str:
    """A database migrated once per set of migrations (named by their digest), that a bench's
    database is copied from: CREATE DATABASE ... TEMPLATE takes well under a second, where
    migrating a new database took 5.4 s. Made under an advisory lock (two benches at once) and
    migrated under a temporary name, so a failed migration leaves no template behind; older
    templates are dropped."""
    prefix = "flywheel_bench_template_"
    name = prefix + _migrations_digest()
    admin.execute("SELECT pg_advisory_lock(hashtext(%s))", [prefix])
    try:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return name
        for (old,) in admin.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",  # a failed
                                    [prefix + "%"]).fetchall():  # build's "_building" copy too
            admin.execute(f'DROP DATABASE IF EXISTS "{old}" WITH (FORCE)')
        building = name + "_building"
        admin.execute(f'CREATE DATABASE "{building}"')
        subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--verbosity", "0"], cwd=ROOT, check=True,
                       env={**os.environ, "DATABASE_URL": bench_database_url(building)})
        admin.execute(f'ALTER DATABASE "{building}" RENAME TO "{name}"')
        return name
    finally:
        admin.execute("SELECT pg_advisory_unlock(hashtext(%s))", [prefix])


def create_database(name: str, *, fresh: bool = False) -> str:
    """Database `name` on the benches' server with the current schema (dropped first when `fresh`),
    copied from the migrations' template when it is new; returns its URL. An existing database is
    kept as it is (the caller migrates it)."""
    import psycopg

    url = bench_database_url(name)
    with psycopg.connect(_admin_url(url), autocommit=True) as admin:
        if fresh:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{_template(admin)}"')
    return url


def setup_django(name: str, *, fresh: bool = False) -> str:
    """Creates database `name` (`create_database`: dropped first when `fresh`, for a bench whose
    tables grow with every run, measured on a database of the same size each time), points Django
    at it and migrates it (nothing to do on a copy of the template), returns its URL."""
    url = create_database(name, fresh=fresh)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return url
