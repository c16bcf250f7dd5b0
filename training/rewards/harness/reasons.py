"""Failure reasons a person can act on, from an exception."""

import errno
import os
import traceback


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
