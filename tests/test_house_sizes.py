"""Size goals (issue 33): no source file over 600 lines and no function over 50 lines (from its
`def` to its last line) outside bench/, tests/ and migrations.

    pytest tests/test_house_sizes.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("core", "feedback", "inference", "kernels", "training", "webapp")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 50

# Functions allowed past the limit, each with the reason it cannot be split.
ALLOWED_LONG = {
    # Django's ASGIHandler.handle copied statement for statement (two thread hops removed);
    # tests/core/test_asgi.py compares the two ASTs, so it must keep Django's shape.
    "core/asgi.py:LoopSignalsHandler.handle",
}


def source_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if "migrations" not in p.parts]


def function_lengths(path: Path, root: Path = ROOT) -> dict[str, int]:
    """`file:Qualified.name` -> lines from its `def` (not its decorators) to its last line."""
    lengths: dict[str, int] = {}
    rel = path.relative_to(root).as_posix()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_no_source_file_is_over_600_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in source_files()}
    assert len(sizes) > 100
    assert {name: n for name, n in sizes.items() if n > MAX_FILE_LINES} == {}


def test_no_function_is_over_50_lines():
    lengths = {k: v for p in source_files() for k, v in function_lengths(p).items()}
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES and name not in ALLOWED_LONG}
    assert long == {}


def test_the_allow_list_names_functions_that_are_still_long():
    lengths = {k: v for p in source_files() for k, v in function_lengths(p).items()}
    assert {name: lengths.get(name) for name in ALLOWED_LONG if lengths.get(name, 0) <= MAX_FUNCTION_LINES} == {}


def test_a_function_is_measured_from_def_to_its_last_line(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("class A:\n    @staticmethod\n    def f():\n        x = 1\n\n        return x\n\n"
                      "def g():\n    def h():\n        pass\n    return h\n")
    assert function_lengths(module, tmp_path) == {"m.py:A.f": 4, "m.py:g": 4, "m.py:g.h": 2}
