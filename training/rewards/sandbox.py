"""The OS boundary around generated code: every run is a fresh bubblewrap (`bwrap`) sandbox.

What the code inside gets (`_bwrap_args`):
- new user, PID, network, IPC, UTS, cgroup and mount namespaces; no further user namespaces,
  no capabilities, uid/gid 65534, a new session, killed with its parent; the harness is the
  namespace's PID 1, so when it ends, everything it might have left behind ends with it;
- a read-only root holding only the base interpreter, its stdlib (site-/dist-packages masked
  by an empty read-only tmpfs), the shared libraries they link (found with `ldd`), a minimal
  /dev and `harness/`: no project tree, no venv, no /etc, no /proc, no /sys; the same root
  whatever the worker's process did before (its environment, sys.path, sysconfig, cwd): the
  layout comes from an isolated run of the base interpreter and ldd runs in an empty environment;
- a private tmpfs work dir (/sandbox/work, `disk_mb` big), an empty environment but HOME/TMPDIR/PATH/LANG;
- a seccomp filter (x86_64, aarch64) refusing new processes (threads are fine), ptrace,
  process_vm_*, bpf, userfaultfd, io_uring, perf_event_open, keyrings, mount/namespace calls,
  module/kexec loading, socket families other than unix/inet/inet6 (AF_VSOCK, AF_NETLINK...), and
  any other syscall ABI (i386, x32): kernel attack surface Python never needs (elsewhere: no
  filter, and RLIMIT_NPROC alone caps forks, unless root);
- rlimits (CPU, AS, FSIZE, NPROC, NOFILE, CORE) set by the harness before any code runs, a
  wall-clock deadline kept by the parent, who then kills the sandbox (its PID namespace dies
  with it, grandchildren included).

Where bwrap is missing or cannot start a sandbox here, `SandboxUnavailable` is raised: no code
runs, and nothing falls back to an unsandboxed path. `FLYWHEEL_BWRAP` names the binary (read
strictly: set means it must be an executable file); unset, `bwrap` is looked up on PATH.

If the worker runs as root, uid 65534 inside maps to root outside (bwrap maps the sandbox user to
its caller): it has no capabilities and nothing writable from the host, but run workers as an
unprivileged user all the same.

    .venv/bin/python -m pytest tests/training/rewards/test_sandbox.py -q -p no:cacheprovider
"""

from __future__ import annotations

import functools
import glob
import json
import os
import platform
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

BWRAP_ENV = "FLYWHEEL_BWRAP"
HARNESS = Path(__file__).with_name("harness")  # a folder of stdlib-only modules, mounted read-only
HARNESS_INSIDE = "/sandbox/harness"
WORKDIR = "/sandbox/work"  # a path no host file is likely to share: the audit hook tells them apart
NOBODY = "65534"


class SandboxUnavailable(RuntimeError):
    """No sandbox can run here (bwrap missing, misconfigured or refused): not the completion's fault."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    fsize_mb: int = 1
    nproc: int = 64
    disk_mb: int = 16
    max_source_chars: int = 100_000


def bwrap_path() -> str:
    """The bwrap binary: `FLYWHEEL_BWRAP` if set (then it must be an executable file), else PATH."""
    configured = os.environ.get(BWRAP_ENV)
    if configured is None:
        found = shutil.which("bwrap")
        if not found:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed, so no check runs code: "
                                     f"run `make sandbox` (Debian package bubblewrap) or set {BWRAP_ENV}")
        return found
    if not (os.path.isabs(configured) and os.path.isfile(configured) and os.access(configured, os.X_OK)):
        raise SandboxUnavailable(f"{BWRAP_ENV}={configured!r} is not an executable file, so no check runs code: "
                                 "point it at bwrap (e.g. /usr/bin/bwrap) or unset it to use PATH")
    return configured


# ---------------------------------------------------------------------------------- the root


# Extension modules whose libraries stay outside (GUI, terminal, NIS, dbm, TLS: useless offline and headless);
# importing one fails with ImportError.
_UNNEEDED_MODULES = {"_tkinter", "readline", "_curses", "_curses_panel", "nis", "_dbm", "_gdbm", "_crypt", "_ssl"}


# Run by the base interpreter itself, isolated (-I: no PYTHON* variables, no user site, no cwd on
# sys.path; -S: no site, so no .pth files) with an empty environment in "/": its answer depends on
# the binary and the file system only, and is the layout the interpreter finds inside (same flags).
_LAYOUT_PROBE = """\
import json, os, sys, sysconfig
print(json.dumps({"executable": sys.executable, "venv": sys.prefix != sys.base_prefix,
                  "stdlib": sysconfig.get_path("stdlib"),
                  "dynload": [p for p in sys.path if os.path.basename(p) == "lib-dynload"]}))
"""
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _interpreter() -> tuple[str, tuple[str, ...]]:
    """(the base interpreter's real path, bwrap args that make it and its stdlib run inside).

    Cached per process, so nothing the worker's process did before its first sandbox (environment
    variables such as LD_PRELOAD, which vLLM's CPU platform sets to torch's libgomp in the venv, PATH,
    sys.path, sysconfig, the cwd) may decide it: the layout comes from a fresh isolated run of the
    base interpreter, and ldd runs from /bin or /usr/bin in an empty environment."""
    exe, stdlib, dynload = _layout()
    args: list[str] = ["--ro-bind", stdlib, stdlib]
    for name in ("site-packages", "dist-packages"):  # third-party code stays outside
        if os.path.isdir(os.path.join(stdlib, name)):
            masked = os.path.join(stdlib, name)
            args += ["--size", "4096", "--tmpfs", masked, "--remount-ro", masked]
    if not dynload.startswith(stdlib + os.sep):
        args += ["--ro-bind", dynload, dynload]
    modules = [m for m in sorted(glob.glob(os.path.join(dynload, "*.so")))
               if os.path.basename(m).split(".")[0] not in _UNNEEDED_MODULES]
    for path in [exe, *_shared_libraries([exe, *modules])]:
        args += [a for step in _path_mounts(path) for a in step]
    _refuse_private_paths(args)
    return exe, tuple(_dedupe(args))


def _layout() -> tuple[str, str, str]:
    """(interpreter, stdlib, lib-dynload), real paths, as the base interpreter reports them when run isolated."""
    # The one input taken from this process: which binary the venv (if any) was made from.
    exe = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    try:
        run = subprocess.run([exe, "-I", "-S", "-c", _LAYOUT_PROBE], capture_output=True, text=True,
                             timeout=60, env={}, cwd="/")
        layout = json.loads(run.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise SandboxUnavailable(f"the base interpreter {exe} could not report its layout: {exc}") from exc
    if layout["venv"] or os.path.realpath(layout["executable"]) != exe:
        raise SandboxUnavailable(f"{exe} is not a base interpreter (it reports {layout['executable']}, "
                                 f"venv: {layout['venv']}): the sandbox runs the base interpreter only")
    stdlib = os.path.realpath(layout["stdlib"])
    dynload = next((os.path.realpath(p) for p in layout["dynload"] if os.path.isdir(p)),
                   os.path.join(stdlib, "lib-dynload"))
    return exe, stdlib, dynload


def _shared_libraries(files: Sequence[str]) -> list[str]:
    # /bin or /usr/bin only (not the worker's PATH), an empty environment (the worker's LD_PRELOAD or
    # LD_LIBRARY_PATH would add or resolve libraries into the venv and mount it, and /work, inside),
    # from "/": which libraries ld.so finds is then a property of the files alone.
    ldd = shutil.which("ldd", path=os.defpath)
    if ldd is None:
        raise SandboxUnavailable("ldd is not installed: the sandbox cannot tell which libraries Python needs")
    lines = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.defpath}, cwd="/").stdout.splitlines()
    found = []
    for line in (ln.strip() for ln in lines):
        target = (line.split("=>", 1)[1] if "=>" in line else line).strip().split(" (", 1)[0]
        if target.startswith("/") and not target.endswith(":"):  # "file:" headers, "not found" skipped
            found.append(target)
    return found


def _refuse_private_paths(args: Sequence[str]) -> None:
    """A last check: nothing from the project tree or the venv is ever mounted, whatever put it there."""
    private = {str(PROJECT_ROOT)}
    if sys.prefix != sys.base_prefix:
        private |= {os.path.abspath(sys.prefix), os.path.realpath(sys.prefix)}
    for arg in args:
        if any(arg == top or arg.startswith(top + os.sep) for top in private):
            raise SandboxUnavailable(f"the sandbox would mount {arg}, inside the project or its venv: refusing")


def _path_mounts(path: str) -> list[tuple[str, ...]]:
    """bwrap args that make `path` resolve inside as outside: each symlink on the way, then the file."""
    if not os.path.isabs(path):  # never resolved against the worker's cwd
        raise SandboxUnavailable(f"not an absolute path: {path!r}")
    steps: list[tuple[str, ...]] = []
    path = os.path.normpath(path)
    for _ in range(40):
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            prefix = os.path.join(*parts[:i])
            if os.path.islink(prefix):
                target = os.readlink(prefix)
                steps.append(("--symlink", target, prefix))
                path = os.path.normpath(os.path.join(os.path.dirname(prefix), target, *parts[i:]))
                break
        else:
            return [*steps, ("--ro-bind", path, path)]
    raise SandboxUnavailable(f"too many symlinks resolving {path}")


def _dedupe(args: list[str]) -> list[str]:
    """Drops repeated mount steps (`--symlink a b`, `--ro-bind a a`), keeping the first of each."""
    out: list[str] = []
    seen: set[tuple[str, ...]] = set()
    i = 0
    while i < len(args):
        width = 2 if args[i] in ("--tmpfs", "--remount-ro", "--size") else 3
        step = tuple(args[i:i + width])
        if args[i] not in ("--symlink", "--ro-bind") or step not in seen:
            out += step
            seen.add(step)
        i += width
    return out


# ---------------------------------------------------------------------------------- seccomp

# syscall numbers, checked against asm/unistd_64.h and asm-generic/unistd.h
_DENIED: dict[str, tuple[int, int | None]] = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "personality": (135, 92), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "acct": (163, 89), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "sethostname": (170, 161), "setdomainname": (171, 162), "quotactl": (179, 60),
    "syslog": (103, 116),
    "fork": (57, None), "vfork": (58, None),  # aarch64 has only clone
}
_CLONE, _CLONE3 = (56, 220), (435, 435)
_SOCKET_CALLS = ((41, 198), (53, 199))  # socket, socketpair: their first argument is the family
# AF_UNIX, AF_INET, AF_INET6 (the network namespace has only its own loopback): every other family
# (AF_VSOCK reaches the hypervisor's host, AF_NETLINK, AF_PACKET, AF_ALG... are kernel attack
# surface) answers EAFNOSUPPORT.
_SOCKET_FAMILIES = (1, 2, 10)
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}  # AUDIT_ARCH_*, column in the tables
_X32_BIT, _CLONE_THREAD = 0x40000000, 0x00010000
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97


def seccomp_program(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp filter (struct sock_filter[]) for this machine; None where unknown.

    Besides the denied calls it refuses new processes (fork, vfork, clone without CLONE_THREAD;
    clone3 answers ENOSYS so libc falls back to clone, whose flags a filter can read): RLIMIT_NPROC
    does not bind a worker running as root, whom the sandbox user maps to. Sockets: only the
    families in `_SOCKET_FAMILIES`."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, col = arch
    prog: list[tuple[int, str | int, str | int, int]] = [
        (_LD, 0, 0, 4), (_JEQ, 0, "kill", audit_arch), (_LD, 0, 0, 0),  # seccomp_data.arch, then .nr
        *([(_JGE, "deny", 0, _X32_BIT)] if col == 0 else []),
        *[(_JEQ, "deny", 0, numbers[col]) for numbers in _DENIED.values() if numbers[col] is not None],
        *[(_JEQ, "socket", 0, numbers[col]) for numbers in _SOCKET_CALLS],
        (_JEQ, "enosys", 0, _CLONE3[col]), (_JEQ, 0, "allow", _CLONE[col]),
        (_LD, 0, 0, 16), (_JSET, "allow", "deny", _CLONE_THREAD),  # clone's flags, low 32 bits
    ]
    blocks = {"socket": [(_LD, 0, 0, 16), *[(_JEQ, "allow", 0, family) for family in _SOCKET_FAMILIES],
                         (_RET, 0, 0, _ERRNO | _EAFNOSUPPORT)],  # args[0], the family (low 32 bits)
              "allow": [(_RET, 0, 0, _ALLOW)], "deny": [(_RET, 0, 0, _ERRNO | _EPERM)],
              "enosys": [(_RET, 0, 0, _ERRNO | _ENOSYS)], "kill": [(_RET, 0, 0, _KILL)]}
    at = {}
    for name, block in blocks.items():
        at[name] = len(prog)
        prog += block

    def jump(i: int, target: str | int) -> int:
        return at[target] - i - 1 if isinstance(target, str) else target

    return b"".join(struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog))


# ---------------------------------------------------------------------------------- processes


def _bwrap_args(limits: SandboxLimits, seccomp_fd: int | None) -> list[str]:
    _, mounts = _interpreter()
    return [
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1",
        "--cap-drop", "ALL", "--uid", NOBODY, "--gid", NOBODY, "--hostname", "sandbox",
        "--clearenv", "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", WORKDIR,
        "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        *mounts,
        "--ro-bind", str(HARNESS), HARNESS_INSIDE,
        "--dev", "/dev", "--remount-ro", "/dev",
        "--size", str(limits.disk_mb << 20), "--perms", "0700", "--tmpfs", WORKDIR, "--chdir", WORKDIR,
        "--remount-ro", "/",
        *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
    ]


@dataclass
class Sandboxed:
    """One running sandbox: the bwrap monitor process, its status pipe and the output file."""

    proc: subprocess.Popen[bytes]
    output: IO[bytes]
    status: int  # read end of bwrap's --json-status-fd; the sandbox never holds it (bwrap sets CLOEXEC)

    def wait(self, deadline: float) -> int | None:
        """Exit code (bwrap reports a signal as 128 + signo), or None if still running at the deadline."""
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kills the sandbox's PID 1 (the harness), which takes every process inside down, and lets
        bwrap reap it. Killing bwrap instead would orphan its child to the host's PID 1: a zombie
        wherever that does not reap, as in many containers (also why `--as-pid-1`: bwrap's own
        init outlives its monitor on a normal exit)."""
        if self.proc.poll() is None:
            init = self._init_pid()
            try:
                if init is not None:
                    os.kill(init, signal.SIGKILL)
                else:
                    os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def _init_pid(self) -> int | None:
        if not select.select([self.status], [], [], 1.0)[0]:
            return None
        try:
            info, _ = json.JSONDecoder().raw_decode(os.read(self.status, 4096).decode())
            pid = int(info["child-pid"])
            # Only ever bwrap's own child: a stale or odd pid must not reach anyone else.
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
        return pid if parent == self.proc.pid else None

    def output_size(self) -> int:
        return self.output.seek(0, os.SEEK_END)

    def output_text(self, limit: int = 4096) -> str:
        self.output.seek(0)
        return self.output.read(limit).decode(errors="replace")

    def close(self) -> None:
        self.kill()
        self.output.close()
        os.close(self.status)


def spawn(role: str, config: Mapping[str, Any], limits: SandboxLimits, fds: Sequence[int] = ()) -> Sandboxed:
    """Starts `harness/main.py ROLE FDS...` in a fresh sandbox; `config` (+ the limits) reaches it on stdin.

    `fds` are the only descriptors the sandbox inherits besides stdin/stdout/stderr."""
    exe, _ = _interpreter()
    seccomp = seccomp_program()
    seccomp_fd = os.memfd_create("flywheel-seccomp") if seccomp is not None else None
    status_r, status_w = os.pipe()
    output = tempfile.TemporaryFile()
    try:
        if seccomp_fd is not None:
            os.write(seccomp_fd, seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps({**config, "limits": asdict(limits)}).encode())
            stdin.seek(0)
            argv = [bwrap_path(), "--json-status-fd", str(status_w), *_bwrap_args(limits, seccomp_fd),
                    exe, "-I", "-S", "-B", "-X", "utf8", f"{HARNESS_INSIDE}/main.py", role, *map(str, fds)]
            keep = (*fds, status_w, *([seccomp_fd] if seccomp_fd is not None else []))
            # env={}: not even bwrap's own /proc/PID/environ holds the worker's secrets.
            proc = subprocess.Popen(argv, stdin=stdin, stdout=output, stderr=subprocess.STDOUT, env={},
                                    pass_fds=keep, start_new_session=True, cwd="/")
    except BaseException:
        output.close()
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
        if seccomp_fd is not None:
            os.close(seccomp_fd)
    return Sandboxed(proc, output, status_r)


def read_until_eof(fd: int, deadline: float, limit: int = 64 * 1024) -> bytes | None:
    """All bytes written to `fd` until every writer closed it (up to `limit`); None at the deadline."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:limit]


@dataclass(frozen=True)
class ScriptRun:
    exit_code: int | None  # None: killed at the wall-clock deadline
    output: str


def run_script(code: str, limits: SandboxLimits | None = None) -> ScriptRun:
    """Runs `code` in a sandbox with the limits but no audit hook: the OS boundary alone."""
    limits = limits or SandboxLimits()
    ensure_available()
    box = spawn("script", {"code": code}, limits)
    try:
        exit_code = box.wait(time.monotonic() + limits.wall_s)
        return ScriptRun(exit_code, box.output_text(64 * 1024))
    finally:
        box.close()


_WORKING: set[str] = set()


def ensure_available() -> None:
    """Raises SandboxUnavailable unless bwrap is there and starts a sandbox here (checked once per binary)."""
    bwrap = bwrap_path()
    if bwrap in _WORKING:
        return
    limits = SandboxLimits(wall_s=30.0)
    box = spawn("script", {"code": "print('sandbox ok')"}, limits)
    try:
        code = box.wait(time.monotonic() + limits.wall_s)
        out = box.output_text()
    finally:
        box.close()
    if code != 0 or out.strip() != "sandbox ok":
        raise SandboxUnavailable(f"bubblewrap ({bwrap}) cannot start a sandbox here (exit code {code}): "
                                 f"{out.strip()[:500] or 'no output'}")
    _WORKING.add(bwrap)
