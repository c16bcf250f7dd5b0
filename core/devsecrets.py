"""Development secrets: random values kept in var/dev-secrets.json (0600), for the demo, the
tests and the benches on one machine. Never use them in production: there SECRET_KEY,
FLYWHEEL_SECRETS_KEY and FLYWHEEL_USER_PEPPER come from the environment (settings refuse to start
without them when DEBUG is off).

    eval $(.venv/bin/python -m core.devsecrets)     # export them into a shell for manage.py

This module never imports Django.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(os.environ.get("FLYWHEEL_VAR_DIR", Path(__file__).resolve().parent.parent / "var"))
NAMES = ("SECRET_KEY", "FLYWHEEL_SECRETS_KEY", "FLYWHEEL_USER_PEPPER")


def _fresh() -> dict[str, str]:
    return {
        "SECRET_KEY": secrets.token_urlsafe(50),
        # A Fernet key: 32 random bytes, urlsafe base64.
        "FLYWHEEL_SECRETS_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
        "FLYWHEEL_USER_PEPPER": secrets.token_urlsafe(32),
    }


def dev_secrets() -> dict[str, str]:
    """The development values, created once per var/ (two processes starting at once agree)."""
    path = ROOT / "dev-secrets.json"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".dev-secrets.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        values = json.loads(path.read_text()) if path.exists() else {}
        if not all(values.get(n) for n in NAMES):
            values = {**_fresh(), **{n: v for n, v in values.items() if v}}
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(values, fh, indent=2)
        path.chmod(0o600)
    return {n: values[n] for n in NAMES}


def setdefault_environ(environ: dict[str, str] | None = None) -> list[str]:
    """Puts the development values into `environ` (os.environ by default) where unset; returns
    the names it set."""
    environ = os.environ if environ is None else environ
    missing = [n for n in NAMES if not environ.get(n)]
    if missing:
        values = dev_secrets()
        for name in missing:
            environ[name] = values[name]
    return missing


if __name__ == "__main__":
    for name, value in dev_secrets().items():
        print(f"export {name}='{value}'")
    sys.exit(0)
