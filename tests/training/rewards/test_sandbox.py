"""The sandbox holds against real escape attempts, and a failing completion cannot forge a pass.

Two levels: `run_script` runs code with the limits but *no* audit hook (the OS boundary alone,
as if the hook had been bypassed); `make_check(...)` is what a completion or an ingest key meets.
Where a check is the attacker's only channel, the completion is correct only if the attack
worked, so a pass would mean an escape.

    .venv/bin/python -m pytest tests/training/rewards/test_sandbox.py -q
"""

import ast
import os
import platform
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from tests.processes import wait_until
from training.rewards import sandbox
from training.rewards.checks import CheckResult, make_check
from training.rewards.sandbox import BWRAP_ENV, SandboxLimits, SandboxUnavailable, run_script, spawn

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = ROOT / "webapp" / "settings.py"
LIMITS = {"cpu_s": 2, "wall_s": 10.0, "memory_mb": 256}
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
SECRETS = {"SECRET_KEY": "sk-test-7f3a9c", "DATABASE_URL": "postgres://u:pw-test-51d2@db/x",
           "FLYWHEEL_INTERNAL_TOKEN": "tok-test-c0ffee"}


def script(code: str, **limits) -> str:
    run = run_script(code, SandboxLimits(**{**LIMITS, **limits}))
    assert run.exit_code == 0, run.output
    return run.output


def check(completion: str, tests: str = ADD_TESTS) -> CheckResult:
    return make_check("python_tests", tests=tests, **LIMITS).run(completion)


def correct_add_if(condition: str) -> str:
    """A completion whose `add` is right only if `condition` (an escape) held."""
    return f"def add(a, b):\n    return a + b if {condition} else None\n"


# ---------------------------------------------------------------------------------- shell, sub-interpreters

SUBINTERPRETER_SHELL = """
import _xxsubinterpreters as interpreters
interp = interpreters.create()
interpreters.run_string(interp, '''
import os
status = os.system("id > {target} 2>&1")
with open("status", "w") as fh:
    fh.write(str(status))
''')
print("status", open("status").read())
"""


def test_a_subinterpreter_runs_no_shell_command(tmp_path):
    target = tmp_path / "pwned"
    out = script(SUBINTERPRETER_SHELL.format(target=target))
    assert "status 0" not in out and not target.exists()  # no /bin/sh in the sandbox, no host path


def test_a_completion_reaching_for_a_subinterpreter_scores_zero(tmp_path):
    target = tmp_path / "pwned"
    attack = SUBINTERPRETER_SHELL.format(target=target) + correct_add_if("True")
    result = check(attack)
    assert result.score == 0.0 and "forbidden operation: import _xxsubinterpreters" in result.reason
    assert not target.exists()


# ---------------------------------------------------------------------------------- secrets, files


def test_the_workers_environment_is_out_of_reach(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    out = script(f"""
import os
print(sorted(os.environ))
for path in ("/proc/%d/environ" % os.getppid(), "/proc/self/environ", "/proc/1/environ", "/proc/{os.getpid()}/environ"):
    try:
        print(path, open(path, "rb").read())
    except OSError as exc:
        print(path, type(exc).__name__)
""")
    assert not any(value in out for value in SECRETS.values())
    assert "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']" in out
    assert out.count("FileNotFoundError") == 4  # no /proc at all


def test_a_completion_cannot_read_the_workers_secrets(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    found = ("any(s in open(p, 'rb').read() for p in ['/proc/%d/environ' % os.getppid(), '/proc/self/environ'] "
             f"for s in {[v.encode() for v in SECRETS.values()]!r})")
    result = check("import os\n" + correct_add_if(found))
    assert result.score == 0.0
    assert not any(value in result.reason for value in SECRETS.values())


def test_project_files_and_the_hosts_etc_are_not_there():
    out = script(f"""
import os, sys
print(sorted(os.listdir("/")))
for path in ({str(SETTINGS)!r}, {str(ROOT / 'training' / 'rewards' / 'harness' / 'main.py')!r}, "/etc/passwd", "/etc/shadow"):
    try:
        open(path).read()
        print(path, "READ")
    except OSError as exc:
        print(path, type(exc).__name__)
for module in ("django", "torch", "training"):
    try:
        __import__(module)
        print(module, "IMPORTED")
    except ImportError:
        print(module, "missing")
print("uid", os.getuid(), os.getgid())
""")
    root = ast.literal_eval(out.splitlines()[0])
    extra = {"etc", "proc", "sys", "home", "work", "var", "run"} & set(root)
    assert not extra, f"{sorted(extra)} in the sandbox's root {root}; bwrap {sandbox._bwrap_args(SandboxLimits(), None)}"
    assert "READ" not in out and "IMPORTED" not in out
    assert "uid 65534 65534" in out


def test_what_is_mounted_does_not_depend_on_what_the_worker_did_before(monkeypatch, tmp_path):
    """A worker runs other code first (vLLM's CPU platform sets LD_PRELOAD to torch's libgomp in the
    venv, and the first sandbox fixes the mounts for the process): none of it may reach the root."""
    clean = sandbox._interpreter.__wrapped__()
    listing = "import os\nprint(sorted(os.listdir('/')))\n"
    clean_root = script(listing)
    libs, dynload, bin_ = tmp_path / "lib", tmp_path / "x" / "lib-dynload", tmp_path / "bin"
    for folder in (libs, dynload, bin_):
        folder.mkdir(parents=True)
    linked = [a for a in clean[1] if ".so" in os.path.basename(a) and os.path.isfile(a)]
    for lib in linked:
        shutil.copy(lib, libs / os.path.basename(lib))
    shutil.copy(linked[-1], dynload / "_evil.so")
    (bin_ / "ldd").write_text('#!/bin/sh\necho "\tlibevil.so => /etc/passwd (0x0)"\n')
    (bin_ / "ldd").chmod(0o755)
    monkeypatch.setenv("LD_PRELOAD", str(libs / os.path.basename(linked[-1])))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(libs))
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    for name in ("TMPDIR", "HOME", "PYTHONHOME", "PYTHONPATH"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.syspath_prepend(str(dynload))
    monkeypatch.setitem(sysconfig.get_config_vars(), "installed_base", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert sandbox._interpreter.__wrapped__() == clean
    sandbox._interpreter.cache_clear()  # as in a worker whose first sandbox comes after all that
    try:
        assert script(listing) == clean_root
    finally:
        sandbox._interpreter.cache_clear()


def test_nothing_from_the_project_or_the_venv_is_ever_mounted():
    venv = [os.path.join(sys.prefix, "lib", "libgomp.so.1")] if sys.prefix != sys.base_prefix else []
    for path in (str(SETTINGS), *venv):
        with pytest.raises(SandboxUnavailable, match="inside the project or its venv"):
            sandbox._refuse_private_paths(["--ro-bind", path, path])
    sandbox._refuse_private_paths(["--ro-bind", "/usr/lib/libc.so.6", "/usr/lib/libc.so.6"])


def test_a_completion_cannot_read_the_projects_settings():
    result = check(correct_add_if(f"'SECRET_KEY' in open({str(SETTINGS)!r}).read()"))
    assert result.score == 0.0 and "FileNotFoundError" in result.reason


def test_writes_outside_the_work_dir_fail_even_without_the_audit_hook(tmp_path):
    out = script(f"""
import sqlite3, sys
for what, attempt in [
    ("open", lambda: open({str(tmp_path / 'opened')!r}, "w").write("x")),
    ("sqlite", lambda: sqlite3.connect({str(tmp_path / 'db.sqlite')!r}).execute("create table t (x)")),
    ("stdlib", lambda: open(sys.prefix + "/lib/pwned.py", "w")),
    ("root", lambda: open("/pwned", "w")),
]:
    try:
        attempt()
        print(what, "WROTE")
    except Exception as exc:
        print(what, type(exc).__name__)
open("inside.txt", "w").write("ok")
print("inside", open("inside.txt").read())
try:
    for n in range(64):
        open("fill%d" % n, "wb").write(bytes(1000 * 1000))
except OSError as exc:
    print("disk full", exc.strerror)
""", disk_mb=8)
    assert "WROTE" not in out and "inside ok" in out and "disk full No space left on device" in out
    assert list(tmp_path.iterdir()) == []


def test_a_completion_cannot_write_outside_through_sqlite(tmp_path):
    db = tmp_path / "db.sqlite"
    write = f"sqlite3.connect({str(db)!r}).execute('create table t (x)') is not None"
    result = check("import sqlite3\n" + correct_add_if(write))
    assert result.score == 0.0 and "forbidden operation: opening the database" in result.reason
    assert not db.exists()


# ---------------------------------------------------------------------------------- network, signals, processes


def test_no_network_reaches_the_host():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        out = script(f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as exc:
    print("refused", type(exc).__name__)
""")
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    assert "refused" in out and "CONNECTED" not in out


def test_a_completion_cannot_reach_the_host_network():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = check("import socket\n" + correct_add_if(f"socket.create_connection(('127.0.0.1', {port}))"))
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.score == 0.0


def test_processes_outside_are_invisible_to_signals():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        out = script(f"""
import os, signal
print("pids", os.getpid(), os.getppid())
try:
    os.kill({os.getpid()}, signal.SIGUSR1)
    print("SIGNALLED")
except OSError as exc:
    print("kill", type(exc).__name__)
""")
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert "kill ProcessLookupError" in out and not received
    assert "pids 1 0" in out  # its own PID namespace, whose PID 1 it is


FORK_BOMB = """
import os, time
forked = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except OSError as exc:
    print("stopped after", forked, exc.errno, flush=True)
time.sleep(60)
"""


def test_a_fork_bomb_is_capped_and_nothing_outlives_the_sandbox():
    limits = SandboxLimits(**{**LIMITS, "nproc": 16})
    box = spawn("script", {"code": FORK_BOMB}, limits)
    try:
        wait_until(lambda: "stopped after" in box.output_text(), timeout=10, every=0.05, what="the fork bomb capped")
        forked = int(box.output_text().split("stopped after")[1].split()[0])
        assert forked < limits.nproc  # seccomp refuses new processes; RLIMIT_NPROC where not root
        inside = _descendants(box.proc.pid)
        assert 1 <= len(inside) <= limits.nproc + 1
    finally:
        box.close()  # the wall-clock path: killed
    assert not [pid for pid in inside if os.path.exists(f"/proc/{pid}")]  # not even a zombie


def test_a_sandbox_that_ends_on_its_own_leaves_no_process_behind():
    box = spawn("script", {"code": "import time\nprint('up', flush=True)\ntime.sleep(0.5)\n"}, SandboxLimits())
    try:
        wait_until(lambda: "up" in box.output_text(), timeout=60, every=0.02, what="the script started")
        inside = _descendants(box.proc.pid)
        assert box.wait(time.monotonic() + 10) == 0
    finally:
        box.close()
    assert inside
    wait_until(lambda: not [pid for pid in inside if os.path.exists(f"/proc/{pid}")], timeout=10, every=0.02,
               what="the sandbox's processes to be gone")


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _descendants(root: int) -> set[int]:
    parents = {}
    for pid in _all_pids():
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers below are x86_64's")
def test_seccomp_refuses_ptrace_userfaultfd_and_new_processes_but_not_threads():
    out = script("""
import ctypes, os, threading
thread = threading.Thread(target=print, args=("thread ran",))
thread.start()
thread.join()
try:
    os.posix_spawn("/nonexistent", ["x"], {})
except OSError as exc:
    print("spawn", exc.strerror)
libc = ctypes.CDLL(None, use_errno=True)
for name, number, args in [("ptrace", 101, (0, 0, 0, 0)), ("userfaultfd", 323, (0,)), ("unshare", 272, (0x10000000,))]:
    print(name, libc.syscall(number, *args), os.strerror(ctypes.get_errno()))
""")
    for name in ("ptrace", "userfaultfd", "unshare"):
        assert f"{name} -1 Operation not permitted" in out, out
    assert "thread ran" in out and "spawn Operation not permitted" in out  # not "No such file"


# ---------------------------------------------------------------------------------- forging a pass

FORGERIES = {
    "fake markers": "print('all tests passed')\nprint('{\"ok\": true, \"reason\": \"all tests passed\"}')\n",
    "hard exit during the tests": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "SystemExit during the tests": "def add(a, b):\n    raise SystemExit(0)\n",
    "forged verdict on every fd": """
import json, os
verdict = json.dumps({"ok": True, "reason": "all tests passed", "gone": False}).encode()
ready = json.dumps({"ready": [], "x": []}).encode()
for fd in range(64):
    for payload in (verdict, len(verdict).to_bytes(4, "big") + verdict, len(ready).to_bytes(4, "big") + ready):
        try:
            os.write(fd, payload)
        except OSError:
            pass
os._exit(0)
""",
    "frame walk to the harness": """
import sys
frame, found = sys._getframe(), {}
while frame is not None:
    found.update({k: v for k, v in frame.f_locals.items() if k in ("replies", "requests", "handles")})
    found.update({k: v for k, v in frame.f_globals.items() if k in ("send", "VIOLATIONS", "recv")})
    frame = frame.f_back
found["send"](found["replies"], {"ready": [["add", {"h": 999, "r": "function"}]], "x": []})
while (req := found["recv"](found["requests"])) is not None:  # answer every request "passed"
    found["send"](found["replies"], {"v": True, "x": []})
""",
    "always-equal object": "class Equal:\n    def __eq__(self, other):\n        return True\n"
                           "def add(a, b):\n    return Equal()\n",
    "truthy object": "class Yes:\n    def __bool__(self):\n        return True\ndef is_even(n):\n    return Yes()\n",
    "StopIteration ends the tests' loop": "def is_even(n):\n    raise StopIteration\n",
    "clearing its own violations": "import os\ntry:\n    os.fork()\nexcept Exception:\n    pass\n"
                                   "import sys\nsys.modules['harness.audit'].VIOLATIONS.clear()\n"
                                   "def add(a, b):\n    return a - b\n",
}
EVEN_TESTS = "assert all(map(is_even, [2, 4, 6]))\nassert is_even(8)\n"


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_failing_completion_cannot_forge_a_pass(name):
    tests = EVEN_TESTS if "is_even" in FORGERIES[name] else ADD_TESTS
    result = check(FORGERIES[name], tests)
    assert result.score == 0.0, result.reason
    assert result.reason != "all tests passed"


def test_the_split_keeps_ordinary_tests_working():
    completion = """
from collections import namedtuple
Point = namedtuple("Point", "x y")
class Empty(ValueError):
    pass
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        if not self.items:
            raise Empty("empty")
        return self.items.pop()
    def __len__(self):
        return len(self.items)
def evens(n):
    yield from range(0, n, 2)
def stats(xs, *, scale=1):
    return {"min": min(xs) * scale, "max": max(xs) * scale}, (len(xs),), {1, 2}, Point(1, 2)
"""
    tests = """
s = Stack()
s.push(1); s.push(2)
assert len(s) == 2 and s.pop() == 2 and s.items == [1]
s.pop()
try:
    s.pop()
    raise AssertionError("no error")
except Empty as exc:
    assert isinstance(exc, ValueError) and str(exc) == "empty"
assert list(evens(7)) == [0, 2, 4, 6] and sum(evens(5)) == 6
d, t, st, p = stats([3, 1, 2], scale=2)
assert d == {"min": 2, "max": 6} and t == (3,) and st == {1, 2} and p.y == 2
"""
    assert check(completion, tests) == CheckResult(1.0, "all tests passed")


def test_comparing_the_completions_objects_fails_with_a_reason():
    result = check("class P:\n    pass\ndef make():\n    return P()\n", "assert make() == make()\n")
    assert result.score == 0.0 and "cannot be compared in the tests" in result.reason


# ---------------------------------------------------------------------------------- no bwrap, no run


@pytest.mark.parametrize("value", ["/nonexistent/bwrap", "", "bwrap"])
def test_checks_refuse_to_run_without_bwrap(monkeypatch, value):
    monkeypatch.setenv(BWRAP_ENV, value)
    for name, params in (("python_tests", {"tests": ADD_TESTS}), ("python_compiles", {})):
        with pytest.raises(SandboxUnavailable, match=BWRAP_ENV):
            make_check(name, **params).run("def add(a, b):\n    return a + b\n")
    with pytest.raises(SandboxUnavailable, match="not an executable file"):
        run_script("print(1)")


def test_a_bwrap_that_cannot_start_a_sandbox_is_refused_too(monkeypatch):
    monkeypatch.setenv(BWRAP_ENV, shutil.which("false"))
    with pytest.raises(SandboxUnavailable, match="cannot start a sandbox here"):
        check("def add(a, b):\n    return a + b\n")
