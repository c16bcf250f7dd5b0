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

import builtins
import collections
import errno
import functools
import json
import math
import operator
import os
import resource
import sys
import traceback

MAX_FRAME = 4 << 20
MAX_DEPTH = 64
VIOLATIONS: list[str] = []


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
        elif event == "sqlite3.connect" and not inside(root, args[0]):  # ":memory:" resolves inside
            violation(f"opening the database {args[0]!r} outside the sandbox directory")
        elif event in PATH_EVENTS and not all(inside(root, a) for a in args if isinstance(a, (str, bytes))):
            violation(f"{event} outside the sandbox directory")

    return hook


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
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ProtocolError("a message is not an object")
    return msg


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
        return {"c": [complex(v).real, complex(v).imag]}
    return handle(v)


def decode(v, handle, depth: int = 0):
    """The inverse of `encode`: builds only plain data, and `handle(tag)` for handles."""
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")

    def down(x):
        return decode(x, handle, depth + 1)

    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [down(x) for x in v]
    if type(v) is not dict or len(v) not in (1, 2, 3, 4):
        raise ProtocolError(f"unexpected {type(v).__name__}")
    try:
        return _decode_tagged(v, down, handle)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ProtocolError(f"bad value: {exc}") from None


def _decode_tagged(v: dict, down, handle):
    if "h" in v:
        return handle(v)
    (tag, body), = v.items()
    if tag == "f" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "b":
        return bytes.fromhex(body)
    if tag == "c" and all(type(x) in (int, float) for x in body):
        return complex(*body)
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
    args = [decode(a, handles.resolve) for a in req.get("a", [])]
    op, name = req["op"], req.get("n", "")
    if op == "call":
        return obj(*args, **{str(k): decode(x, handles.resolve) for k, x in req.get("k", [])})
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

    def receive(self) -> dict:
        try:
            msg = recv(self.replies)
        except (ProtocolError, ValueError) as exc:
            raise self.fail(CandidateFault(f"the code under test broke the protocol ({exc})")) from None
        if msg is None:
            raise self.fail(CandidateGone("the code under test ended without a result"))
        violations = msg.get("x")
        if violations:
            raise self.fail(CandidateFault(f"forbidden operation: {str(violations[0])[:300]}"))
        return msg

    def start(self) -> dict:
        msg = self.receive()
        if "fail" in msg:
            raise self.fail(CandidateFault(str(msg["fail"])[:500]))
        if type(msg.get("ready")) is not list:
            raise self.fail(CandidateFault("the code under test broke the protocol (no names)"))
        names = {str(pair[0]): self.decode(pair[1]) for pair in msg["ready"]}
        return {name: value for name, value in names.items() if not name.startswith("__")}

    def ask(self, op: str, hid: int, **fields):
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
            raise self.fail(CandidateFault("the code under test broke the protocol (no value)"))
        return self.decode(msg["v"])

    def decode(self, value):
        try:
            return decode(value, self.proxy)
        except ProtocolError as exc:
            raise self.fail(CandidateFault(f"the code under test broke the protocol ({exc})")) from None

    def encode(self, value):
        return encode(value, self.handle_of)

    def proxy(self, tag: dict):
        hid, kind = int(tag["h"]), str(tag.get("r", "object"))[:100]
        if "exc" not in tag:
            return Remote(self, hid, kind)
        if hid not in self.exc_classes:
            base = builtin_exception(tag["exc"], allow_stop=True) or Exception
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
        name, text = str(msg.get("e"))[:100], str(msg.get("m", ""))[:1000]
        cls = self.exc_classes.get(msg.get("c")) or builtin_exception(msg.get("exc"), allow_stop)
        if cls is not None and issubclass(cls, (StopIteration, StopAsyncIteration)) and not allow_stop:
            cls = None  # a call that "stops" would end the tests' loops (map, all) early
        try:
            exc = (cls or RemoteError)(text)
        except TypeError:  # builtins with other signatures (UnicodeDecodeError...)
            exc = RemoteError(text)
        exc.flywheel_where, exc.flywheel_name = str(msg.get("w", ""))[:200], name
        return exc


class Remote:
    """A candidate's object, seen from the tests: every use is a request; nothing answers locally.

    Truth value and comparisons raise: a verdict must rest on plain data compared here, not on
    an object's own __eq__/__bool__ (an always-equal object would otherwise pass any assert)."""

    __slots__ = ("_peer", "_hid", "_kind")

    def __init__(self, peer: Peer, hid: int, kind: str) -> None:
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_hid", hid)
        object.__setattr__(self, "_kind", kind)

    def _ask(self, op: str, *args, **fields):
        peer = object.__getattribute__(self, "_peer")
        return peer.ask(op, object.__getattribute__(self, "_hid"), a=[peer.encode(x) for x in args], **fields)

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
        return self._ask("len")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __contains__(self, item):
        return self._ask("contains", item)

    def __str__(self):
        text = self._ask("str")
        if type(text) is not str:
            raise TypeError("__str__ of the code under test returned a non-string")
        return text

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
    for name in ("neg", "pos", "abs", "invert", "index", "int", "float"):
        setattr(Remote, f"__{name}__", lambda self, _op=name: self._ask("op", n=_op))


_operator_methods()


def run_tests(tests: str, peer: Peer) -> tuple[bool, str, bool]:
    """(passed, reason, the candidate ended early)."""
    try:
        code = compile(tests, "tests.py", "exec", dont_inherit=True)
        namespace = {"__name__": "__tests__", "__builtins__": builtins, **peer.start()}
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
    ok, reason, gone = run_tests(cfg["tests"], Peer(replies, requests))
    os.write(result, json.dumps({"ok": ok, "reason": reason, "gone": gone}).encode())
    os._exit(0)


# ---------------------------------------------------------------------------------- compile, script


def compile_only(cfg: dict, result: int) -> None:
    try:
        compile(cfg["source"], "solution.py", "exec", dont_inherit=True)
        ok, reason = True, "compiles"
    except BaseException as exc:  # noqa: BLE001 - a parser crash is a failed check
        ok, reason = False, describe(exc, "solution.py")
    os.write(result, json.dumps({"ok": ok, "reason": reason}).encode())
    os._exit(0)


def compile_many(cfg: dict, result: int) -> None:
    """Compile each source (never run one): compiling executes nothing, so sources cannot affect
    one another; a source that exhausts a limit fails the whole batch, which is then checked
    one by one outside."""
    out = []
    for source in cfg["sources"]:
        try:
            compile(source, "solution.py", "exec", dont_inherit=True)
            out.append({"ok": True, "reason": "compiles"})
        except BaseException as exc:  # noqa: BLE001 - a parser crash is a failed check
            out.append({"ok": False, "reason": describe(exc, "solution.py")})
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
