"""Runs inside the sandbox subprocess (`python -I _harness.py CONFIG`): never imported by Flywheel.

Order matters: limits first, then the nonce (read before any untrusted code runs), then the
audit hook, which Python offers no way to remove, then the untrusted code.
"""

import errno
import json
import os
import resource
import sys
import traceback

VIOLATIONS: list[str] = []


class SandboxViolation(PermissionError):
    """A PermissionError, so stdlib code that tolerates OSError (bytecode caching) keeps working."""


def set_limits(cfg: dict) -> None:
    mb = 1024 * 1024
    for name, soft, hard in [
        ("RLIMIT_CPU", cfg["cpu_s"], cfg["cpu_s"] + 1),
        ("RLIMIT_AS", cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
        ("RLIMIT_FSIZE", cfg["fsize_mb"] * mb, cfg["fsize_mb"] * mb),
        ("RLIMIT_NPROC", cfg["nproc"], cfg["nproc"]),
        ("RLIMIT_NOFILE", 64, 64),
        ("RLIMIT_CORE", 0, 0),
    ]:
        resource.setrlimit(getattr(resource, name), (soft, hard))


BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.sendto", "socket.sethostname",
    "resource.setrlimit", "resource.prlimit", "sys.addaudithook", "os.setuid", "os.setgid",
}
BLOCKED_IMPORTS = {"_posixsubprocess", "_ctypes", "ctypes", "multiprocessing", "_multiprocessing", "pty"}
PATH_EVENTS = {
    "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
    "os.chmod", "os.chown", "os.utime", "os.chflags", "os.lchflags", "shutil.rmtree", "os.mkfifo", "os.mknod",
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def inside(root: str, path: object) -> bool:
    if isinstance(path, int) or path is None:  # an fd already open: its opening was checked
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep) or real == os.devnull


def make_hook(root: str):
    def violation(what: str) -> None:
        VIOLATIONS.append(what)
        raise SandboxViolation(f"sandbox: {what} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS:
            violation(event)
        elif event == "import" and args[0].split(".")[0] in BLOCKED_IMPORTS:
            violation(f"import {args[0]}")
        elif event == "open" and _writes(args) and not inside(root, args[0]):
            violation(f"writing {args[0]!r} outside the sandbox directory")
        elif event in PATH_EVENTS and not all(inside(root, a) for a in args if isinstance(a, (str, bytes))):
            violation(f"{event} outside the sandbox directory")

    return hook


def _writes(args: tuple) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def run(cfg: dict) -> tuple[bool, str]:
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        code = compile(cfg["source"], "solution.py", "exec", dont_inherit=True)
        if cfg["mode"] == "compile":
            return True, "compiles"
        exec(code, namespace)
        exec(compile(cfg["tests"], "tests.py", "exec", dont_inherit=True), namespace)
    except SyntaxError as exc:
        return False, f"syntax error: {exc.msg} (line {exc.lineno})"
    except MemoryError:
        return False, "memory limit exceeded"
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            return False, "file size limit exceeded (output or a file too large)"
        return False, f"{type(exc).__name__}: {str(exc)[:300]}"
    except SystemExit as exc:
        return False, f"exited early (SystemExit {exc.code!r}) before the tests finished"
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is a failed check
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
        return False, f"{type(exc).__name__}{at}: {str(exc)[:300]}"
    return True, "all tests passed"


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    os.remove(sys.argv[1])  # the config holds the nonce; gone before untrusted code runs
    set_limits(cfg)
    nonce, result_path = cfg.pop("nonce"), os.path.realpath(cfg["result"])
    sys.dont_write_bytecode = True
    root = os.path.realpath(os.getcwd())
    sys.path.insert(0, root)
    sys.addaudithook(make_hook(root))
    ok, reason = run(cfg)
    if VIOLATIONS:  # even if the code caught the exception, the attempt fails the check
        ok, reason = False, f"forbidden operation: {VIOLATIONS[0]}"
    sys.stdout.flush()
    # O_EXCL | O_NOFOLLOW: a file or link the code planted under this name is never written through.
    fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as fh:
        json.dump({"nonce": nonce, "ok": ok, "reason": reason}, fh)
    os._exit(0)  # skip atexit handlers the untrusted code may have registered


if __name__ == "__main__":
    main()
