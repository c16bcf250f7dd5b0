"""Frames and values between the candidate and the tests: a 4-byte big-endian length, then
UTF-8 JSON; values are plain data, tagged (tuples, sets, bytes...), or handles to objects that
stay with the candidate. Decoding builds plain data only (no pickle, no code)."""

import builtins
import collections
import functools
import json
import math
import os

MAX_FRAME = 4 << 20
MAX_DEPTH = 64

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
