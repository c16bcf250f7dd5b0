"""What is decided without running anything: compiling, and whether a completion or a test
snippet holds any code at all."""

import ast
import io
import json
import os
import tokenize

from .reasons import describe

SILENT_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                 tokenize.ENDMARKER}

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
