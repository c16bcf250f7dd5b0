"""The candidate's audit hook: defence in depth inside the candidate (the OS sandbox is the
boundary): forbidden attempts fail the check with a readable reason even when the code catches
the exception."""

import os

VIOLATIONS: list[str] = []


class SandboxViolation(PermissionError):
    """A PermissionError, so stdlib code that tolerates OSError (bytecode caching) keeps working."""


BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.sendto", "socket.sethostname",
    "resource.setrlimit", "resource.prlimit", "sys.addaudithook", "os.setuid", "os.setgid",
}
BLOCKED_IMPORTS = {"_posixsubprocess", "_ctypes", "ctypes", "multiprocessing", "_multiprocessing", "pty",
                   "_xxsubinterpreters", "_interpreters", "_xxinterpchannels", "_interpchannels"}
# event -> (index of a path argument, index of the dir_fd it is relative to, or None) pairs
PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)), "os.symlink": ((0, 2), (1, 2)), "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),), "shutil.rmtree": ((0, 1),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def inside(root: str, path: object, dir_fd: object = None) -> bool:
    """Whether `path` (relative to `dir_fd` if one is given, else to the cwd) resolves under `root`."""
    if not isinstance(path, (str, bytes, os.PathLike)):  # an fd already open: its opening was checked
        return True
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # -1: none given
        base = dir_path(dir_fd)
        if base is None:
            return False
        path = os.path.join(base, path)
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep) or real == os.devnull


def dir_path(fd: int) -> str | None:
    """The real path of the directory open as `fd` (no /proc inside: by changing into it and back)."""
    here = os.open(".", os.O_RDONLY)
    try:
        os.fchdir(fd)
        return os.getcwd()
    except OSError:
        return None
    finally:
        os.fchdir(here)
        os.close(here)


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
        elif event == "sqlite3.connect" and not inside(root, args[0]):  # ":memory:" resolves inside
            violation(f"opening the database {args[0]!r} outside the sandbox directory")
        elif event in PATH_EVENTS and not all(
                inside(root, args[p], None if d is None else args[d]) for p, d in PATH_EVENTS[event]):
            violation(f"{event} outside the sandbox directory")

    return hook


def checked_open(root: str, real_open):
    """`os.open` for the candidate: the "open" audit event carries no dir_fd, so a write relative
    to one is checked here against the directory's real path."""

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None and isinstance(flags, int) and flags & WRITE_FLAGS and not inside(root, path, dir_fd):
            VIOLATIONS.append(f"writing {path!r} (relative to a directory fd) outside the sandbox directory")
            raise SandboxViolation(f"sandbox: {VIOLATIONS[-1]} is not allowed")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    return open_


def _writes(args: tuple) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & WRITE_FLAGS)
