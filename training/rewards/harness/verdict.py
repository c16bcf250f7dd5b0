"""The tests role: runs the test snippet against proxies of the candidate's names and writes the
verdict to the result fd, which the candidate never holds. No candidate code runs here."""

import builtins
import json
import os

from .reasons import describe
from .static import tests_nothing
from .wire import ProtocolError, builtin_exception, decode, encode, recv, send

# Taken before any other code runs: the tests see these builtins, whatever names the candidate defines.
PRISTINE_BUILTINS = dict(vars(builtins))

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
