"""Runs inside the bubblewrap sandbox (`python -I -S harness.py ROLE [FD...]`): never imported by Flywheel.

One file, stdlib only: it is the one file of the project the sandbox can see. checks.py states
the design; the roles in short:

    compile    compile the source, never run it; the verdict goes to the result fd.
    candidate  run prefix + completion under the audit hook, send its top-level names, then answer
               the tests' requests (call, attribute, item, operator...) with plain data or an opaque
               handle. Untrusted from the first line of the code on: what it sends is only ever a
               value inside the tests, never a verdict.
    tests      run the test snippet with proxies for the candidate's names and write the verdict to
               the result fd, which the candidate never holds. No candidate code runs here.
    script     limits, then the code, nothing else: the OS boundary alone (tests of the sandbox).

The config (JSON: code, limits) arrives on stdin, which is read and replaced by /dev/null first.
Wire format between candidate and tests: a 4-byte big-endian length, then UTF-8 JSON.
"""

import ast
import builtins
import collections
import errno
import functools
import io
import json
import math
import operator
import os
import posix
import resource
import sys
import tokenize
import traceback

MAX_FRAME = 4 << 20
MAX_DEPTH = 64
VIOLATIONS: list[str] = []
# Taken before any other code runs: the tests see these builtins, whatever names the candidate defines.
PRISTINE_BUILTINS = dict(vars(builtins))


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


# ---------------------------------------------------------------------------------- audit hook
# Defence in depth inside the candidate (the OS sandbox is the boundary): forbidden attempts fail
# the check with a readable reason even when the code catches the exception.

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
SILENT_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                 tokenize.ENDMARKER}
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


# ---------------------------------------------------------------------------------- wire


class ProtocolError(Exception):
    pass


def send(fd: int, msg: dict) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"value too large to send ({len(data)} bytes > {MAX_FRAME})")
    buf = memoryview(len(data).to_bytes(4, "big") + data)
    while buf:
        buf = buf[os.write(fd, buf):]


def recv(fd: int) -> dict | None:
    """The next message, or None once the other side is gone."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes")
    body = _read_exact(fd, size)
    if body is None:
        return None
    try:
        msg = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError, MemoryError) as exc:  # nested past the limit, huge numbers
        raise ProtocolError(f"malformed frame ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message is not an object")
    return msg


def _no_constant(name: str):
    raise ProtocolError(f"{name} in a frame: non-finite numbers travel tagged")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ProtocolError(f"non-finite number {text[:20]!r} in a frame")
    return value


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode(v, handle, depth: int = 0):
    """Plain data as tagged JSON; anything else goes through `handle(v)` (an id, or a refusal)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to send")

    def down(x):
        return encode(x, handle, depth + 1)

    if v is None or type(v) in (bool, str, int):
        return v
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else {"f": repr(float(v))}
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, list):
        return [down(x) for x in list.__iter__(v)]
    if isinstance(v, tuple) and isinstance(getattr(type(v), "_fields", None), tuple):
        return {"nt": [type(v).__name__, list(type(v)._fields), [down(x) for x in tuple.__iter__(v)]]}
    if isinstance(v, tuple):
        return {"t": [down(x) for x in tuple.__iter__(v)]}
    if isinstance(v, dict):
        return {"d": [[down(k), down(x)] for k, x in dict.items(v)]}
    if isinstance(v, frozenset):
        return {"fs": [down(x) for x in frozenset.__iter__(v)]}
    if isinstance(v, set):
        return {"s": [down(x) for x in set.__iter__(v)]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, complex):
        return {"c": [down(complex(v).real), down(complex(v).imag)]}
    return handle(v)


def decode(v, handle, depth: int = 0, finite: bool = True):
    """The inverse of `encode`: builds only plain data, and `handle(tag)` for handles.

    `finite`: a NaN or infinity is a ProtocolError (the tests' side: an answer that compares
    false with everything would pass any "fail if error > tol" test)."""
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")

    def down(x):
        return decode(x, handle, depth + 1, finite)

    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return _checked_float(v, finite)
    if type(v) is list:
        return [down(x) for x in v]
    if type(v) is not dict or len(v) not in (1, 2, 3, 4):
        raise ProtocolError(f"unexpected {type(v).__name__}")
    try:
        return _decode_tagged(v, down, handle, finite)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ProtocolError(f"bad value: {exc}") from None


def _checked_float(x: float, finite: bool) -> float:
    if finite and not math.isfinite(x):
        raise ProtocolError(f"a non-finite number ({x!r}) is not an answer")
    return x


def _decode_tagged(v: dict, down, handle, finite: bool):
    if "h" in v:
        return handle(v)
    (tag, body), = v.items()
    if tag == "f" and body in ("nan", "inf", "-inf"):
        return _checked_float(float(body), finite)
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        parts = [down(x) for x in body]
        if all(type(x) in (int, float) for x in parts):
            return complex(*parts)
    if type(body) is not list:
        raise ProtocolError(f"bad {tag!r} body")
    if tag == "nt":
        name, fields, values = body
        return _namedtuple(str(name), tuple(str(f) for f in fields))(*[down(x) for x in values])
    items = [down(x) for x in body]
    makers = {"t": tuple, "s": set, "fs": frozenset, "d": lambda kv: dict((k, x) for k, x in kv)}
    if tag not in makers:
        raise ProtocolError(f"unknown tag {tag!r}")
    return makers[tag](items)


@functools.lru_cache(maxsize=256)
def _namedtuple(name: str, fields: tuple) -> type:
    return collections.namedtuple(name, fields)  # validates both as identifiers: no code injection


def builtin_exception(names, allow_stop: bool):
    """The first builtin Exception subclass among `names` (an MRO); StopIteration only if allowed."""
    for name in names if isinstance(names, list) else []:
        cls = getattr(builtins, str(name), None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            if issubclass(cls, (StopIteration, StopAsyncIteration)) and not allow_stop:
                continue
            return cls
    return None


def describe(exc: BaseException, frame_file: str) -> str:
    """A failure reason: the exception, where it happened (the last frame in `frame_file`), its text."""
    if isinstance(exc, SyntaxError):
        return f"syntax error: {exc.msg} (line {exc.lineno})"
    if isinstance(exc, MemoryError):
        return "memory limit exceeded"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file size limit exceeded (output or a file too large)"
    if isinstance(exc, SystemExit):
        return f"exited early (SystemExit {exc.code!r}) before the tests finished"
    where = getattr(exc, "flywheel_where", "") or where_in(exc, frame_file)
    at = f" at {where}" if where else ""
    name = getattr(exc, "flywheel_name", type(exc).__name__)
    return f"{name}{at}: {str(exc)[:300]}"


def where_in(exc: BaseException, frame_file: str) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename == frame_file] or frames[-1:]
    return f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno}" if ours else ""


# ---------------------------------------------------------------------------------- candidate


class Handles:
    """Objects the tests may refer to by id (kept alive here, so ids stay unique)."""

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.ids: dict[int, int] = {}

    def tag(self, obj) -> dict:
        hid = self.ids.get(id(obj))
        if hid is None:
            hid = self.ids[id(obj)] = len(self.objects) + 1
            self.objects[hid] = obj
        tag = {"h": hid, "r": type(obj).__name__}
        if isinstance(obj, type) and issubclass(obj, BaseException):
            tag.update(r=obj.__name__, exc=[c.__name__ for c in obj.__mro__])
        return tag

    def resolve(self, tag: dict):
        return self.objects[tag["h"]]


OPERATORS = {name: getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor",
    "lshift", "rshift", "neg", "pos", "abs", "invert", "index")}
OPERATORS.update(int=int, float=float)


def answer(req: dict, handles: Handles):
    obj = handles.resolve(req)
    args = [decode(a, handles.resolve, finite=False) for a in req.get("a", [])]
    op, name = req["op"], req.get("n", "")
    if op == "call":
        return obj(*args, **{str(k): decode(x, handles.resolve, finite=False) for k, x in req.get("k", [])})
    simple = {"getattr": lambda: getattr(obj, name), "len": lambda: len(obj), "iter": lambda: iter(obj),
              "next": lambda: next(obj), "str": lambda: str(obj), "repr": lambda: repr(obj),
              "setattr": lambda: setattr(obj, name, args[0]), "delattr": lambda: delattr(obj, name),
              "getitem": lambda: obj[args[0]], "delitem": lambda: operator.delitem(obj, args[0]),
              "setitem": lambda: operator.setitem(obj, args[0], args[1]),
              "contains": lambda: args[0] in obj,
              "op": lambda: OPERATORS[name](obj, *args), "rop": lambda: OPERATORS[name](args[0], obj)}
    return simple[op]()


def candidate_reply(req: dict, handles: Handles) -> dict:
    try:
        reply = {"v": encode(answer(req, handles), handles.tag)}
    except BaseException as exc:  # noqa: BLE001 - the tests decide what an exception means
        where = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "solution.py"][-1:]
        reply = {"e": type(exc).__name__, "m": str(exc)[:1000], "exc": [c.__name__ for c in type(exc).__mro__],
                 "w": f"solution.py:{where[0].lineno}" if where else "", "c": handles.ids.get(id(type(exc)))}
    reply["x"] = VIOLATIONS[:1]
    return reply


def run_candidate(source: str, namespace: dict) -> str | None:
    """Runs the code; the failure reason, or None."""
    try:
        code = compile(source, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        return describe(exc, "solution.py")
    root = os.path.realpath(os.getcwd())
    sys.path.insert(0, root)
    sys.addaudithook(make_hook(root))
    os.open = posix.open = checked_open(root, posix.open)
    try:
        exec(code, namespace)
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code fails the check
        failure = describe(exc, "solution.py")
    else:
        failure = None
    return f"forbidden operation: {VIOLATIONS[0]}" if VIOLATIONS else failure


def candidate(cfg: dict, requests: int, replies: int) -> None:
    namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
    failure = run_candidate(cfg["source"], namespace)
    try:
        sys.stdout.flush()
    except OSError:  # over the output limit: the failure already says so
        pass
    handles = Handles()
    if failure is not None:
        send(replies, {"fail": failure, "x": VIOLATIONS[:1]})
        os._exit(0)
    names = []
    for name, value in list(namespace.items()):
        if not name.startswith("__"):
            try:
                names.append([name, encode(value, handles.tag)])
            except ValueError:  # nested too deeply to copy: the tests get a handle instead
                names.append([name, handles.tag(value)])
    send(replies, {"ready": names, "x": VIOLATIONS[:1]})
    while (req := recv(requests)) is not None:
        send(replies, candidate_reply(req, handles))
    os._exit(0)  # skip atexit handlers the untrusted code may have registered


# ---------------------------------------------------------------------------------- tests


class CandidateFault(BaseException):
    """The candidate broke the run (ended, misbehaved, a forbidden attempt): a BaseException, so
    a test snippet's `except Exception` never swallows it; the verdict checks `Peer.fault` too."""

    gone = False

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CandidateGone(CandidateFault):
    gone = True


class RemoteError(Exception):
    """An exception of the candidate's that has no builtin counterpart here."""


class Peer:
    """The tests' side of the pipe pair: asks, decodes strictly, keeps the first fault."""

    def __init__(self, replies: int, requests: int) -> None:
        self.replies, self.requests = replies, requests
        self.fault: CandidateFault | None = None
        self.exc_classes: dict[int, type] = {}
        self.exc_ids: dict[type, int] = {}

    def fail(self, fault: CandidateFault) -> CandidateFault:
        self.fault = self.fault or fault
        return self.fault

    def broke(self, what: str) -> CandidateFault:
        return self.fail(CandidateFault(f"the code under test broke the protocol ({what})"))

    def receive(self) -> dict:
        """The next frame, validated here, outside the tests' code: whatever is wrong with it
        (nesting, sizes, types) is a fault, never an exception a test's `except` could swallow."""
        try:
            msg = recv(self.replies)
        except Exception as exc:  # noqa: BLE001 - any malformed frame is the candidate's fault
            raise self.broke(str(exc)[:200] if isinstance(exc, ProtocolError) else type(exc).__name__) from None
        if msg is None:
            raise self.fail(CandidateGone("the code under test ended without a result"))
        violations = msg.get("x", [])
        if type(violations) is not list:
            raise self.broke("bad violations list")
        if violations:
            raise self.fail(CandidateFault(f"forbidden operation: {str(violations[0])[:300]}"))
        return msg

    def start(self) -> dict:
        """The candidate's top-level names, less those of builtins: a test's `all([...])` or
        `isinstance` is always the builtin, whatever the candidate defined."""
        msg = self.receive()
        if type(msg.get("fail")) is str:
            raise self.fail(CandidateFault(msg["fail"][:500]))
        pairs = msg.get("ready")
        if type(pairs) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in pairs):
            raise self.broke("no names")
        return {name: self.decode(value) for name, value in pairs
                if not name.startswith("__") and name not in PRISTINE_BUILTINS}

    def ask(self, op: str, hid: int, want=None, **fields):
        """The candidate's answer to one request; `want(value)` says whether its type is one
        the operation can return (a forged frame could send any)."""
        if self.fault is not None:
            raise self.fault
        try:
            send(self.requests, {"op": op, "h": hid, **fields})
        except OSError:
            raise self.fail(CandidateGone("the code under test ended without a result")) from None
        msg = self.receive()
        if "e" in msg:
            raise self.remote_error(msg, allow_stop=op == "next")
        if "v" not in msg:
            raise self.broke("no value")
        value = self.decode(msg["v"])
        if want is not None and not want(value):
            raise self.broke(f"{op} answered with a {type(value).__name__}")
        return value

    def decode(self, value):
        try:
            return decode(value, self.proxy)
        except Exception as exc:  # noqa: BLE001 - ProtocolError, or anything building a value raised
            raise self.broke(str(exc)[:200] if isinstance(exc, ProtocolError) else type(exc).__name__) from None

    def encode(self, value):
        return encode(value, self.handle_of)

    def proxy(self, tag: dict):
        hid, kind, mro = tag.get("h"), tag.get("r", "object"), tag.get("exc", [])
        if type(hid) is not int or type(kind) is not str or not _names(mro):
            raise ProtocolError("bad handle")
        kind = kind[:100]
        if "exc" not in tag:
            return Remote(self, hid, kind)
        if hid not in self.exc_classes:
            base = builtin_exception(mro, allow_stop=True) or Exception
            cls = type(kind, (base,), {"__module__": "solution"})
            self.exc_classes[hid], self.exc_ids[cls] = cls, hid
        return self.exc_classes[hid]

    def handle_of(self, value) -> dict:
        if isinstance(value, Remote):
            return {"h": object.__getattribute__(value, "_hid")}
        if isinstance(value, type) and value in self.exc_ids:
            return {"h": self.exc_ids[value]}
        raise TypeError(f"cannot pass a {type(value).__name__} to the code under test: "
                        "only plain data (int, str, list, dict, ...) and values it returned")

    def remote_error(self, msg: dict, allow_stop: bool) -> BaseException:
        """The exception to raise in the tests for an error reply; a malformed one, or one that is
        no Exception (SystemExit, KeyboardInterrupt: it would skip the tests' `except Exception`
        in plain Python and end the run), is a fault."""
        name, text, where, mro, cid = (msg.get(k, d) for k, d in
                                       (("e", None), ("m", ""), ("w", ""), ("exc", None), ("c", None)))
        if not (type(name) is str and type(text) is str and type(where) is str and _names(mro)
                and (cid is None or type(cid) is int)):
            return self.broke("malformed error reply")
        if "Exception" not in mro:
            return self.fail(CandidateFault(f"the code under test raised {name[:100]} during the tests"))
        name, text = name[:100], text[:1000]
        cls = self.exc_classes.get(cid) or builtin_exception(mro, allow_stop)
        if cls is not None and issubclass(cls, (StopIteration, StopAsyncIteration)) and not allow_stop:
            cls = None  # a call that "stops" would end the tests' loops (map, all) early
        try:
            exc = (cls or RemoteError)(text)
        except TypeError:  # builtins with other signatures (UnicodeDecodeError...)
            exc = RemoteError(text)
        exc.flywheel_where, exc.flywheel_name = where[:200], name
        return exc


def _names(value) -> bool:
    """A list of strings (an MRO's class names)."""
    return type(value) is list and all(type(x) is str for x in value)


class Remote:
    """A candidate's object, seen from the tests: every use is a request; nothing answers locally.

    Truth value and comparisons raise: a verdict must rest on plain data compared here, not on
    an object's own __eq__/__bool__ (an always-equal object would otherwise pass any assert)."""

    __slots__ = ("_peer", "_hid", "_kind")

    def __init__(self, peer: Peer, hid: int, kind: str) -> None:
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_kind", kind)

    def _ask(self, op: str, *args, want=None, **fields):
        peer = object.__getattribute__(self, "_peer")
        return peer.ask(op, object.__getattribute__(self, "_hid"), want, a=[peer.encode(x) for x in args], **fields)

    def __getattr__(self, name):
        return self._ask("getattr", n=name)

    def __setattr__(self, name, value):
        self._ask("setattr", value, n=name)

    def __delattr__(self, name):
        self._ask("delattr", n=name)

    def __call__(self, *args, **kwargs):
        peer = object.__getattribute__(self, "_peer")
        return self._ask("call", *args, k=[[k, peer.encode(v)] for k, v in kwargs.items()])

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __delitem__(self, key):
        self._ask("delitem", key)

    def __len__(self):
        return self._ask("len", want=lambda n: type(n) is int and n >= 0)

    def __iter__(self):
        return self._ask("iter", want=lambda it: isinstance(it, Remote))

    def __next__(self):
        return self._ask("next")

    def __contains__(self, item):
        return self._ask("contains", item, want=lambda b: type(b) is bool)

    def __str__(self):
        return self._ask("str", want=lambda text: type(text) is str)

    def __repr__(self):
        try:
            text = self._ask("repr")
        except Exception:  # noqa: BLE001 - repr is for messages; a fault is kept by the peer
            text = None
        return text if type(text) is str else f"<{object.__getattribute__(self, '_kind')} from the code under test>"

    def __bool__(self):
        raise TypeError(f"a {object.__getattribute__(self, '_kind')} from the code under test has no "
                        "truth value in the tests: return a bool or plain data")

    def _refuse_compare(self, other):
        raise TypeError(f"a {object.__getattribute__(self, '_kind')} from the code under test cannot be "
                        "compared in the tests: return plain data (int, str, list, dict, ...)")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse_compare
    __hash__ = object.__hash__


def _operator_methods() -> None:
    binary = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift")
    for name in binary:
        op = name + "_" if name in ("and", "or") else name
        setattr(Remote, f"__{name}__", lambda self, other, _op=op: self._ask("op", other, n=_op))
        setattr(Remote, f"__r{name}__", lambda self, other, _op=op: self._ask("rop", other, n=_op))
    for name in ("neg", "pos", "abs", "invert"):
        setattr(Remote, f"__{name}__", lambda self, _op=name: self._ask("op", n=_op))
    # What Python itself requires these to return: another type raises in the tests, where a
    # test's `except` could swallow it; here it is a fault.
    for name, kind in (("index", int), ("int", int), ("float", float)):
        setattr(Remote, f"__{name}__",
                lambda self, _op=name, _kind=kind: self._ask("op", n=_op, want=lambda v: type(v) is _kind))


_operator_methods()


def run_tests(tests: str, peer: Peer) -> tuple[bool, str, bool]:
    """(passed, reason, the candidate ended early)."""
    try:
        code = compile(tests, "tests.py", "exec", dont_inherit=True)
        namespace = {"__name__": "__tests__", "__builtins__": dict(PRISTINE_BUILTINS), **peer.start()}
        exec(code, namespace)
    except CandidateFault as fault:
        return False, fault.reason, fault.gone
    except BaseException as exc:  # noqa: BLE001 - any failure of the tests fails the check
        if peer.fault is None:
            return False, describe(exc, "tests.py"), False
    if peer.fault is not None:  # raised inside the tests and swallowed there
        return False, peer.fault.reason, peer.fault.gone
    return True, "all tests passed", False


def tests(cfg: dict, replies: int, requests: int, result: int) -> None:
    if tests_nothing(cfg["tests"]):
        verdict = {"ok": False, "reason": "the test snippet has no statement that tests anything "
                   "(only blank lines, comments, docstrings or pass): give it asserts", "refused": True}
    else:
        ok, reason, gone = run_tests(cfg["tests"], Peer(replies, requests))
        verdict = {"ok": ok, "reason": reason, "gone": gone}
    os.write(result, json.dumps(verdict).encode())
    os._exit(0)


def _inert(node: ast.stmt) -> bool:
    """A statement that does nothing: `pass`, or a lone constant (a docstring, `...`)."""
    return isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))


def tests_nothing(tests: str) -> bool:
    try:
        body = ast.parse(tests).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False  # compiling it reports the error
    return all(_inert(node) for node in body)


def adds_nothing(source: str, start: int) -> bool:
    """Whether everything from `start` on (the completion; the source compiles) is comments,
    blank lines or inert statements (docstrings, `pass`, `...`): it verifies nothing, and would
    pass on the strength of a prefix that compiles alone. Fails closed: untokenizable is nothing."""
    try:
        tree = ast.parse(source)
        lines = source.split("\n")
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line) + 1)

        def at(lineno: int, col: int, utf8: bool = False) -> int:
            text = lines[lineno - 1]
            return offsets[lineno - 1] + (len(text.encode()[:col].decode(errors="ignore")) if utf8 else col)

        inert = [(at(n.lineno, n.col_offset, True), at(n.end_lineno, n.end_col_offset, True))
                 for n in ast.walk(tree) if isinstance(n, ast.stmt) and _inert(n)]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            first, last = at(*tok.start), at(*tok.end)
            if tok.type in SILENT_TOKENS or last <= start:
                continue
            if not any(a <= first and last <= b for a, b in inert):
                return False
    except (SyntaxError, ValueError, RecursionError, MemoryError, IndexError, tokenize.TokenError):
        return True
    return True


# ---------------------------------------------------------------------------------- compile, script


def compile_one(source: str, start: int) -> dict:
    try:
        compile(source, "solution.py", "exec", dont_inherit=True)
    except BaseException as exc:  # noqa: BLE001 - a parser crash is a failed check
        return {"ok": False, "reason": describe(exc, "solution.py")}
    if adds_nothing(source, start):
        return {"ok": False, "reason": "the completion adds no code (only comments, docstrings or pass)"}
    return {"ok": True, "reason": "compiles"}


def compile_only(cfg: dict, result: int) -> None:
    os.write(result, json.dumps(compile_one(cfg["source"], cfg.get("start", 0))).encode())
    os._exit(0)


def compile_many(cfg: dict, result: int) -> None:
    """Compile each source (never run one): compiling executes nothing, so sources cannot affect
    one another; a source that exhausts a limit fails the whole batch, which is then checked
    one by one outside."""
    starts = cfg.get("starts") or [0] * len(cfg["sources"])
    out = [compile_one(source, start) for source, start in zip(cfg["sources"], starts, strict=True)]
    os.write(result, json.dumps({"ok": True, "reason": "batch", "results": out}).encode())
    os._exit(0)


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
