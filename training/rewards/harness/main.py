"""The sandbox's entry point: `python -I -S /sandbox/harness/main.py ROLE [FD...]` (see __init__.py)."""

import builtins
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # -I: not done for us

from harness.candidate import candidate  # noqa: E402 - after the path
from harness.static import compile_many, compile_only  # noqa: E402
from harness.verdict import tests  # noqa: E402


def read_config() -> dict:
    with os.fdopen(0, "rb") as fh:
        cfg = json.loads(fh.read())
    os.open(os.devnull, os.O_RDONLY)  # lowest free fd: 0 again
    return cfg


def set_limits(limits: dict) -> None:
    mb = 1024 * 1024
    for name, soft, hard in [
        ("RLIMIT_CPU", limits["cpu_s"], limits["cpu_s"]),  # SIGKILL: PID 1 of a namespace ignores SIGXCPU
        ("RLIMIT_AS", limits["memory_mb"] * mb, limits["memory_mb"] * mb),
        ("RLIMIT_FSIZE", limits["fsize_mb"] * mb, limits["fsize_mb"] * mb),
        ("RLIMIT_NPROC", limits["nproc"], limits["nproc"]),
        ("RLIMIT_NOFILE", 64, 64),
        ("RLIMIT_CORE", 0, 0),
    ]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def main() -> None:
    role, fds = sys.argv[1], [int(fd) for fd in sys.argv[2:]]
    cfg = read_config()
    set_limits(cfg["limits"])
    if role == "script":
        exec(compile(cfg["code"], "script.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    elif role == "compile":
        compile_only(cfg, *fds)
    elif role == "compile_many":
        compile_many(cfg, *fds)
    elif role == "candidate":
        candidate(cfg, *fds)
    elif role == "tests":
        tests(cfg, *fds)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
