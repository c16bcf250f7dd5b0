"""docs/architecture.md's "grep for" table names things that exist.

Each row's second cell is a list of backticked names. A file or folder (`feedback/events.py`,
`training/gate/`) must exist, and the names after it, up to the next `;`, must be defined in it
(a function, class, assignment, or a class's member: `PolicyServer.load`). A name with no file
before it must be defined somewhere in the code. Upper-case names (settings, environment
variables) and `--options` must appear in the file's text; `manage.py CMD ...` names a
management command and its options; `make TARGET VAR=1` a Makefile target; `GET /api/...` a
route. One row per behaviour: no behaviour and no grep cell twice.

    pytest tests/core/test_architecture_doc.py -q
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCE_DIRS = ("core", "feedback", "inference", "kernels", "training", "webapp", "bench")


def table_rows() -> list[tuple[str, str]]:
    """(behaviour, grep cell) of each row under "## Where things are"."""
    text = DOC.read_text().split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("behaviour", "---"):
            continue
        rows.append((cells[0], cells[1]))
    return rows


@functools.cache
def source_files() -> tuple[Path, ...]:
    return tuple(p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")))


@functools.cache
def definitions(path: Path) -> frozenset[str]:
    """Names a module defines: functions, classes, assigned names, and `Class.member` for each
    member of a class (methods, class attributes, `self.x` assigned in its methods)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            for member in ast.walk(node):
                for name in _member_names(member):
                    names.add(f"{node.name}.{name}")
    return frozenset(names)


def _member_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.id if isinstance(t, ast.Name) else t.attr for t in targets
                if isinstance(t, ast.Name) or (isinstance(t, ast.Attribute)
                                               and isinstance(t.value, ast.Name) and t.value.id == "self")]
    return []


@functools.cache
def parameters(path: Path, function: str) -> frozenset[str]:
    params: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            a = node.args
            params.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)
    return frozenset(params)


@functools.cache
def routes() -> frozenset[str]:
    """The first argument of every `path(...)`/`re_path(...)` in the code, without slashes."""
    found = set()
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("path", "re_path") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.add(node.args[0].value.strip("/^$"))
    return frozenset(found - {""})


def command_file(name: str) -> Path | None:
    hits = sorted(ROOT.glob(f"*/management/commands/{name}.py"))
    return hits[0] if hits else None


def module_file(name: str) -> Path | None:
    """`feedback.models` or a module's base name (`serve_policy`)."""
    dotted = ROOT / (name.replace(".", "/") + ".py")
    if dotted.is_file():
        return dotted
    hits = [p for p in source_files() if p.stem == name]
    return hits[0] if len(hits) == 1 else None


class Checker:
    """Resolves one row's names in order; a file or folder sets where the next names live."""

    def __init__(self) -> None:
        self.file: Path | None = None
        self.folder: Path | None = None

    def check(self, name: str) -> str | None:
        """None when `name` exists, else what is wrong."""
        if name.startswith("manage.py ") or re.match(r"^\w+ --", name):
            return self._command(name.removeprefix("manage.py ").split())
        if name.startswith("make "):
            return self._make(name.split()[1:])
        if name.startswith(("GET ", "POST ", "PUT ", "/")):
            route = name.split()[-1].strip("/")
            return None if any(route.endswith(r) for r in routes()) else f"no route {route}"
        if "/" in name or name.endswith((".py", ".html")):
            return self._path(name)
        if name.startswith("--") or re.fullmatch(r"[A-Z][A-Z0-9_]+", name) or re.fullmatch(r"\w+=\w+", name):
            return self._text(name.split("=")[0])
        call = re.fullmatch(r"(\w+)\((\w+)=.*\)", name)
        if call:
            return self._parameter(*call.groups())
        return self._defined(name)

    def _path(self, name: str) -> str | None:
        if "/" not in name and self.folder is not None:
            path = self.folder / name
        else:
            path = ROOT / name
        if "*" in name:
            return None if list(ROOT.glob(name)) else f"nothing matches {name}"
        if name.endswith("/"):
            self.folder, self.file = path, None
            return None if path.is_dir() else f"no folder {name}"
        if not path.is_file():
            return f"no file {name}"
        self.file = path if path.suffix == ".py" else None
        return None

    def _command(self, words: list[str]) -> str | None:
        path = command_file(words[0])
        if path is None:
            return f"no management command {words[0]}"
        text = path.read_text()
        missing = [w for w in words[1:] if w != "..." and f'"{w}"' not in text]
        return f"{words[0]} has no {missing}" if missing else None

    def _make(self, words: list[str]) -> str | None:
        text = (ROOT / "Makefile").read_text()
        if not re.search(rf"^{re.escape(words[0])}:", text, re.M):
            return f"no make target {words[0]}"
        missing = [w.split("=")[0] for w in words[1:] if w.split("=")[0] not in text]
        return f"Makefile has no {missing}" if missing else None

    def _text(self, name: str) -> str | None:
        files = [self.file] if self.file else [*source_files(), ROOT / "tests" / "conftest.py"]
        if any(name in p.read_text() for p in files):
            return None
        return f"{name} not in {self._where()}"

    def _parameter(self, function: str, param: str) -> str | None:
        files = [self.file] if self.file else source_files()
        if any(param in parameters(p, function) for p in files):
            return None
        return f"no {function}({param}=) in {self._where()}"

    def _defined(self, name: str) -> str | None:
        head, _, rest = name.rpartition(".")
        module = module_file(head) if head and "." not in rest and head[0].islower() else None
        if module is not None:
            return None if rest in definitions(module) else f"{rest} not defined in {module.relative_to(ROOT)}"
        files = [self.file] if self.file else source_files()
        if any(name in definitions(p) for p in files):
            return None
        return f"{name} not defined in {self._where()}"

    def _where(self) -> str:
        return str(self.file.relative_to(ROOT)) if self.file else "the code"


def row_problems(cell: str) -> list[str]:
    problems = []
    for clause in cell.split(";"):
        checker = Checker()
        for name in re.findall(r"`([^`]+)`", clause):
            problem = checker.check(name)
            if problem:
                problems.append(f"`{name}`: {problem}")
    return problems


def test_every_name_in_the_grep_table_exists():
    rows = table_rows()
    assert len(rows) > 100
    wrong = {behaviour: p for behaviour, cell in rows if (p := row_problems(cell))}
    assert wrong == {}


def test_the_table_has_one_row_per_behaviour():
    rows = table_rows()
    behaviours = [b for b, _ in rows]
    cells = [c for _, c in rows]
    assert sorted({b for b in behaviours if behaviours.count(b) > 1}) == []
    assert sorted({c for c in cells if cells.count(c) > 1}) == []


def test_a_stale_name_is_reported():
    assert row_problems("`feedback/events.py` `parse_event`, `no_such_parser`") == [
        "`no_such_parser`: no_such_parser not defined in feedback/events.py"]
    assert row_problems("`training/no_such_module.py`") == ["`training/no_such_module.py`: no file training/no_such_module.py"]
    assert row_problems("`manage.py train_now --no-such-option`") == [
        "`manage.py train_now --no-such-option`: train_now has no ['--no-such-option']"]
    assert row_problems("`inference/serving.py` `PolicyServer.no_such_method`") != []
    assert row_problems("`GET /api/v1/no_such_route`") != []
