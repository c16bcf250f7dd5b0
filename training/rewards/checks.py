"""Verifiable checks on a completion: pluggable (`Check` + registry), untrusted code sandboxed.

A check on model output runs hostile text, so "python_compiles" and "python_tests" both run in
a subprocess (`python -I`, fresh temp dir as cwd, scrubbed env) under RLIMIT_CPU / AS / FSIZE /
NPROC / NOFILE, a wall timeout that kills the whole process group, and an audit hook (which
Python cannot remove once added) refusing fork/exec/subprocess/ctypes/sockets and writes
outside the temp dir. A hostile completion scores 0 with a reason; the caller is untouched.
Not a security boundary against a determined attacker (that needs OS isolation; set `run_as`
to an unprivileged user where the interpreter is readable by it): a guard for training rewards.

    .venv/bin/python -m pytest tests/training/test_checks.py -q -p no:django
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).with_name("_harness.py")


@dataclass(frozen=True)
class CheckResult:
    score: float  # in [0, 1]
    reason: str

    @property
    def passed(self) -> bool:
        return self.score >= 1.0


class CheckConfigError(ValueError):
    """The check was set up wrongly (unknown name, missing test snippet): not the completion's fault."""


class Check(ABC):
    name: str = ""

    @abstractmethod
    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        """Score `completion`; context may hold `prefix` (code before it) and check inputs."""


CHECKS: dict[str, type[Check]] = {}


def register_check(name: str) -> Callable[[type[Check]], type[Check]]:
    def add(cls: type[Check]) -> type[Check]:
        cls.name = name
        CHECKS[name] = cls
        return cls

    return add


def make_check(name: str, **params: Any) -> Check:
    if name not in CHECKS:
        raise CheckConfigError(f"unknown check {name!r}; known checks: {sorted(CHECKS)}")
    return CHECKS[name](**params)


def check_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A check's parameters from its config entry ({"name", "weight", ...}): those nested under
    "params" and those inline next to name/weight (the nested ones win). The one reading of the
    shape, so that validating a spec and scoring with it cannot disagree."""
    inline = {k: v for k, v in config.items() if k not in ("name", "weight", "params")}
    return {**inline, **config.get("params", {})}


def check_from_config(config: Mapping[str, Any]) -> Check:
    return make_check(config["name"], **check_params(config))


# ---------------------------------------------------------------------------------- sandbox

@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    fsize_mb: int = 1
    nproc: int = 64
    max_source_chars: int = 100_000


def _env(workdir: str) -> dict[str, str]:
    # Proxies point at a closed port so HTTP clients fail fast even where a socket slipped through.
    dead = "http://127.0.0.1:9"
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
            "all_proxy": dead, "no_proxy": "", "PYTHONHASHSEED": "0"}


def run_sandboxed(source: str, tests: str, mode: str, limits: SandboxLimits, run_as: str | None = None) -> CheckResult:
    """Compile (`mode="compile"`) or run source + tests in a fresh sandbox; pass iff the harness says so."""
    if len(source) + len(tests) > limits.max_source_chars:
        return CheckResult(0.0, f"source too long ({len(source) + len(tests)} > {limits.max_source_chars} chars)")
    workdir = tempfile.mkdtemp(prefix="flywheel-check-")
    try:
        return _run_in(workdir, source, tests, mode, limits, run_as)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: str, source: str, tests: str, mode: str, limits: SandboxLimits, run_as: str | None) -> CheckResult:
    nonce = secrets.token_hex(16)
    cfg = {"source": source, "tests": tests, "mode": mode, "nonce": nonce, "result": "result.json",
           **{k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "fsize_mb", "nproc")}}
    cfg_path = os.path.join(workdir, "config.json")
    with open(os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
        json.dump(cfg, fh)
    if run_as:
        shutil.chown(workdir, run_as)
        shutil.chown(cfg_path, run_as)
    with tempfile.TemporaryFile() as out:
        code, timed_out = _spawn([sys.executable, "-I", str(HARNESS), cfg_path], workdir, out, limits, run_as)
        size = out.seek(0, os.SEEK_END)
        out.seek(0)
        tail = out.read(4096).decode(errors="replace")
    if size >= limits.fsize_mb * 1024 * 1024:
        tail = f"output limit exceeded ({limits.fsize_mb} MB)"
    return _verdict(workdir, nonce, code, timed_out, tail, limits)


def _spawn(argv: list[str], workdir: str, out: Any, limits: SandboxLimits, run_as: str | None) -> tuple[int, bool]:
    user = {"user": run_as, "group": run_as, "extra_groups": []} if run_as else {}
    proc = subprocess.Popen(argv, cwd=workdir, env=_env(workdir), stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True, **user)
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc.pid)  # also reaps anything the code managed to leave behind
        proc.wait()
    return proc.returncode, timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _verdict(workdir: str, nonce: str, code: int, timed_out: bool, tail: str, limits: SandboxLimits) -> CheckResult:
    if timed_out:
        return CheckResult(0.0, f"wall-clock limit exceeded ({limits.wall_s:g} s)")
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return CheckResult(0.0, f"CPU time limit exceeded ({limits.cpu_s} s)")
    result = _read_result(os.path.join(workdir, "result.json"))
    if result is None or result.get("nonce") != nonce:
        last = tail.strip().splitlines()[-1:] or ["no output"]
        return CheckResult(0.0, f"sandbox ended without a result (exit code {code}): {last[0][:300]}")
    return CheckResult(1.0 if result["ok"] else 0.0, str(result["reason"]))


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # never follow a link the code planted
        with open(fd) as fh:
            data = json.loads(fh.read(10_000))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------- checks

class _SandboxCheck(Check):
    def __init__(self, run_as: str | None = None, **limits: Any) -> None:
        self.limits = SandboxLimits(**limits)
        self.run_as = run_as

    @staticmethod
    def source(completion: str, context: Mapping[str, Any]) -> str:
        return str(context.get("prefix", "")) + completion


@register_check("python_compiles")
class PythonCompiles(_SandboxCheck):
    """1 if prefix + completion compiles as Python (compiled in the sandbox: parsers can crash)."""

    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        ctx = context or {}
        return run_sandboxed(self.source(completion, ctx), "", "compile", self.limits, self.run_as)


@register_check("python_tests")
class PythonTests(_SandboxCheck):
    """1 if prefix + completion, then the test snippet (`context["tests"]` or `tests=`), run clean."""

    def __init__(self, tests: str | None = None, run_as: str | None = None, **limits: Any) -> None:
        super().__init__(run_as=run_as, **limits)
        self.tests = tests

    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        ctx = context or {}
        tests = ctx.get("tests", self.tests)
        if not tests:
            raise CheckConfigError("python_tests needs a test snippet: pass tests= or context['tests']")
        return run_sandboxed(self.source(completion, ctx), str(tests), "exec", self.limits, self.run_as)
