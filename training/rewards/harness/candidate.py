"""The candidate role: runs prefix + completion under the audit hook, sends its top-level names,
then answers the tests' requests. Everything here after the first line of the code is untrusted."""

import builtins
import operator
import os
import posix
import sys
import traceback

from .audit import VIOLATIONS, checked_open, make_hook
from .reasons import describe
from .wire import decode, encode, recv, send


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
