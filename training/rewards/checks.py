"""Verifiable checks on a completion: pluggable (`Check` + registry), untrusted code sandboxed.

Who runs what. Prefix, completion and test snippet all come from outside (model output, ingest),
so none of them runs in this process, and every run is a fresh bubblewrap sandbox (sandbox.py:
no network, no /proc, no project files, no environment, read-only root, rlimits, wall clock).
Without a working bwrap a check raises `SandboxUnavailable` instead of scoring: nothing ever
runs unsandboxed, and a broken deployment is not read as a bad completion.

Who decides the verdict. A pass must be earned by the tests running to their end, so the code
under test never shares a process, a file, a pipe or a secret with whatever reports it:

- the *candidate* sandbox runs prefix + completion (under an audit hook, for readable reasons
  and defence in depth), then serves requests over a pipe pair: call this, get that attribute,
  item, operator... answering with plain data (JSON: numbers, strings, lists, dicts, tuples,
  sets, bytes) or an opaque handle;
- the *tests* sandbox runs the test snippet against proxies of the candidate's names. Asserts
  are evaluated there, on data decoded strictly (no pickle, no code); a proxy refuses `==`,
  ordering and truth value, so an object's own `__eq__`/`__bool__` cannot pass an assert;
- the *parent* (this module) reads the verdict only from a third pipe that only the tests
  sandbox holds, and maps exit statuses to reasons (CPU limit, early exit).

So the candidate cannot write the verdict (no fd to it, no shared file; separate PID namespaces,
so it cannot see, signal or trace the tests process either), cannot end the run "successfully"
(`os._exit(0)` or a crash is "ended without a result"), and printing or frame walking finds no
nonce because there is none. What it can do is answer the tests' calls: returning the right
values is passing. Limits of the split: values are copied (a test that mutates a list in place
through the candidate sees its own copy), callbacks cannot be passed to the candidate, and a
test that compares the candidate's objects (not data) fails with a reason saying so. All of
these fail closed. A test sees the candidate's top-level names except those of builtins: its
`all`, `sorted` or `isinstance` are always the builtins (a task must not name its function
after one); and a test that evals what the candidate returns runs the candidate's code with the
tests' powers. Non-finite numbers (NaN compares false with everything, so it would pass a "fail
if error > tol" test) and malformed frames are faults of the candidate, decided outside the
tests' code, so no `except Exception` in a snippet can swallow them. A test snippet is
trusted to state the verdict (it is the spec), not to run outside the sandbox.
"python_compiles" runs only the compiler, in one sandbox, and reports on the same kind of pipe.

    .venv/bin/python -m pytest tests/training/rewards/test_checks.py tests/training/rewards/test_sandbox.py -q -p no:django
"""

from __future__ import annotations

import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.rewards.sandbox import (
    Sandboxed,
    SandboxLimits,
    SandboxUnavailable,
    ensure_available,
    read_until_eof,
    spawn,
)
from training.rewards.usefulness import MIN_ACCEPT_CHARS, accepted_chars, first_line, kept_share

__all__ = ["CHECKS", "Check", "CheckConfigError", "CheckResult", "SandboxLimits", "SandboxUnavailable",
           "make_check", "register_check", "run_sandboxed"]


@dataclass(frozen=True)
class CheckResult:
    score: float  # in [0, 1]
    reason: str

    @property
    def passed(self) -> bool:
        return self.score >= 1.0


class CheckConfigError(ValueError):
    """The check was set up wrongly (unknown name, missing test snippet): not the completion's fault."""


class Check(ABC):
    name: str = ""

    @abstractmethod
    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        """Score `completion`; context may hold `prefix` (code before it) and check inputs."""

    def run_many(self, items: Sequence[tuple[str, Mapping[str, Any] | None]]) -> list[CheckResult]:
        """`run` over (completion, context) pairs; a check may do it in fewer sandboxes."""
        return [self.run(completion, context) for completion, context in items]


CHECKS: dict[str, type[Check]] = {}


def register_check(name: str) -> Callable[[type[Check]], type[Check]]:
    def add(cls: type[Check]) -> type[Check]:
        cls.name = name
        CHECKS[name] = cls
        return cls

    return add


def make_check(name: str, **params: Any) -> Check:
    if name not in CHECKS:
        raise CheckConfigError(f"unknown check {name!r}; known checks: {sorted(CHECKS)}")
    return CHECKS[name](**params)


def check_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A check's parameters from its config entry ({"name", "weight", ...}): those nested under
    "params" and those inline next to name/weight (the nested ones win). The one reading of the
    shape, so that validating a spec and scoring with it cannot disagree."""
    inline = {k: v for k, v in config.items() if k not in ("name", "weight", "params")}
    return {**inline, **config.get("params", {})}


def check_from_config(config: Mapping[str, Any]) -> Check:
    return make_check(config["name"], **check_params(config))


# ---------------------------------------------------------------------------------- sandbox

CPU_KILLED = (128 + 24, 128 + 9)  # bwrap's exit code for SIGXCPU and SIGKILL (RLIMIT_CPU's hard limit)


def run_sandboxed(source: str, tests: str, mode: str, limits: SandboxLimits, start: int = 0) -> CheckResult:
    """Compile (`mode="compile"`) or run source + tests in fresh sandboxes; pass iff the tests sandbox says so.

    `start`: where the completion begins in `source` (what comes before is the prefix); compiling
    fails a completion that adds only comments, docstrings or `pass`. A test snippet that tests
    nothing (blank, comments, docstrings) raises CheckConfigError: it would pass any code."""
    if len(source) + len(tests) > limits.max_source_chars:
        return CheckResult(0.0, f"source too long ({len(source) + len(tests)} > {limits.max_source_chars} chars)")
    ensure_available()
    deadline = time.monotonic() + limits.wall_s
    if mode == "compile":
        return _compile(source, start, limits, deadline)
    return _run_tests(source, tests, limits, deadline)


def _compile(source: str, start: int, limits: SandboxLimits, deadline: float) -> CheckResult:
    result_r, result_w = os.pipe()
    try:
        box = spawn("compile", {"source": source, "start": start}, limits, fds=(result_w,))
    finally:
        os.close(result_w)
    try:
        raw = read_until_eof(result_r, deadline)
        return _verdict(raw, box, box, limits, deadline)
    finally:
        os.close(result_r)
        box.close()


def _run_tests(source: str, tests: str, limits: SandboxLimits, deadline: float) -> CheckResult:
    requests_r, requests_w = os.pipe()  # tests -> candidate
    replies_r, replies_w = os.pipe()  # candidate -> tests
    result_r, result_w = os.pipe()  # tests -> here; the candidate never holds it
    boxes: list[Sandboxed] = []
    try:
        boxes.append(spawn("candidate", {"source": source}, limits, fds=(requests_r, replies_w)))
        boxes.append(spawn("tests", {"tests": tests}, limits, fds=(replies_r, requests_w, result_w)))
    except BaseException:
        for box in boxes:
            box.close()
        os.close(result_r)
        raise
    finally:
        for fd in (requests_r, requests_w, replies_r, replies_w, result_w):
            os.close(fd)  # else EOF never comes when a sandbox dies
    candidate, tester = boxes
    try:
        return _verdict(read_until_eof(result_r, deadline), tester, candidate, limits, deadline)
    finally:
        os.close(result_r)
        tester.close()
        candidate.close()


def _verdict(raw: bytes | None, judge: Sandboxed, candidate: Sandboxed, limits: SandboxLimits,
             deadline: float) -> CheckResult:
    """The judge's (tests or compile sandbox) verdict; exit statuses explain a missing one."""
    if raw is None:
        return CheckResult(0.0, f"wall-clock limit exceeded ({limits.wall_s:g} s)")
    result = _parse(raw)
    if result is None:
        return _ended(judge, "the test run", limits, deadline)
    if result["ok"]:
        return CheckResult(1.0, str(result["reason"]))
    if result.get("refused") is True:
        raise CheckConfigError(str(result["reason"]))
    if result.get("gone"):
        return _ended(candidate, "the code under test", limits, deadline)
    return CheckResult(0.0, str(result["reason"]))


def _ended(box: Sandboxed, who: str, limits: SandboxLimits, deadline: float) -> CheckResult:
    code = box.wait(deadline)
    if code is None:
        return CheckResult(0.0, f"wall-clock limit exceeded ({limits.wall_s:g} s)")
    if code in CPU_KILLED:
        return CheckResult(0.0, f"CPU time limit exceeded ({limits.cpu_s} s)")
    if box.output_size() >= limits.fsize_mb << 20:
        return CheckResult(0.0, f"output limit exceeded ({limits.fsize_mb} MB)")
    last = box.output_text().strip().splitlines()[-1:] or ["no output"]
    return CheckResult(0.0, f"{who} ended without a result (exit code {code}): {last[0][:300]}")


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("ok"), bool) and "reason" in data else None


# ---------------------------------------------------------------------------------- checks

class _SandboxCheck(Check):
    """`prompt_is_prefix=True`: with no `prefix` in the context, the prompt is the code before the
    completion (a raw `/v1/completions` prompt, e.g. tab completion: the editor's text so far)."""

    def __init__(self, prompt_is_prefix: bool = False, **limits: Any) -> None:
        self.prompt_is_prefix = bool(prompt_is_prefix)
        self.limits = SandboxLimits(**limits)

    def prefix(self, context: Mapping[str, Any]) -> str:
        prefix = context.get("prefix")
        if prefix is None and self.prompt_is_prefix:
            prefix = context.get("prompt", "")
        return str(prefix or "")

    def source(self, completion: str, context: Mapping[str, Any]) -> str:
        return self.prefix(context) + completion


NOTHING_SUGGESTED = CheckResult(0.0, "empty completion: nothing to verify")


@register_check("python_compiles")
class PythonCompiles(_SandboxCheck):
    """1 if prefix + completion compiles as Python (compiled in the sandbox: parsers can crash)."""

    batch = 64  # sources per sandbox in run_many: a sandbox costs ~0.1 s, compiling one ~0.1 ms

    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        if not completion.strip():
            return NOTHING_SUGGESTED
        prefix = self.prefix(context or {})
        return run_sandboxed(prefix + completion, "", "compile", self.limits, start=len(prefix))

    def run_many(self, items: Sequence[tuple[str, Mapping[str, Any] | None]]) -> list[CheckResult]:
        # An empty suggestion verifies nothing: with a prefix that compiles on its own it would
        # otherwise pass, and a policy learns silence (measured: candidates refused for concision).
        todo = [i for i, (completion, _) in enumerate(items) if completion.strip()]
        prefixes = [self.prefix(items[i][1] or {}) for i in todo]
        sources = [(p + items[i][0], len(p)) for i, p in zip(todo, prefixes, strict=True)]
        compiled: list[CheckResult] = []
        for first in range(0, len(sources), self.batch):
            compiled += self._compile_batch(sources[first : first + self.batch])
        out = [NOTHING_SUGGESTED] * len(items)
        for i, result in zip(todo, compiled, strict=True):
            out[i] = result
        return out

    def _compile_batch(self, sources: list[tuple[str, int]]) -> list[CheckResult]:
        """(source, where its completion starts) pairs, compiled in one sandbox."""
        if sum(len(s) for s, _ in sources) > self.limits.max_source_chars:
            return [run_sandboxed(s, "", "compile", self.limits, start) for s, start in sources]
        ensure_available()
        deadline = time.monotonic() + self.limits.wall_s
        result_r, result_w = os.pipe()
        config = {"sources": [s for s, _ in sources], "starts": [start for _, start in sources]}
        try:
            box = spawn("compile_many", config, self.limits, fds=(result_w,))
        finally:
            os.close(result_w)
        try:
            raw = read_until_eof(result_r, deadline)
        finally:
            os.close(result_r)
            box.close()
        results = (_parse(raw) or {}).get("results") if raw is not None else None
        if not isinstance(results, list) or len(results) != len(sources):
            # One source exhausted a limit (or the batch failed): each gets its own verdict.
            return [run_sandboxed(s, "", "compile", self.limits, start) for s, start in sources]
        return [CheckResult(1.0 if r.get("ok") is True else 0.0, str(r.get("reason", ""))[:2000]) for r in results]


@register_check("python_tests")
class PythonTests(_SandboxCheck):
    """1 if prefix + completion, then the test snippet (`context["tests"]` or `tests=`), run clean."""

    def __init__(self, tests: str | None = None, **limits: Any) -> None:
        super().__init__(**limits)
        self.tests = tests

    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        ctx = context or {}
        tests = ctx.get("tests", self.tests)
        if not tests or not str(tests).strip():
            raise CheckConfigError("python_tests needs a test snippet (it is missing or blank, and would "
                                   "pass any code): pass tests= or context['tests'] with asserts")
        return run_sandboxed(self.source(completion, ctx), str(tests), "exec", self.limits)


@register_check("intent_match")
class IntentMatch(Check):
    """What a tab-completion user kept: the characters of the suggestion's first line that match
    what they were about to type (`context["rest"]`, the rest of the real line), over that rest's
    length, in [0, 1] (training/rewards/usefulness.py `accepted_chars`, the rule the simulated
    users, replay rollouts and the gate's matched-characters row apply). Pure string work: nothing
    runs, so no sandbox."""

    def __init__(self, min_chars: int | None = None) -> None:
        self.min_chars = MIN_ACCEPT_CHARS if min_chars is None else int(min_chars)
        if self.min_chars < 1:
            raise CheckConfigError(f"intent_match's min_chars must be at least 1, got {min_chars!r}")

    def run(self, completion: str, context: Mapping[str, Any] | None = None) -> CheckResult:
        rest = (context or {}).get("rest")
        if not isinstance(rest, str) or not first_line(rest):
            raise CheckConfigError("intent_match needs context['rest']: the rest of the line the user was about to "
                                   "type (a non-empty string) for every prompt it scores")
        if not completion.strip():
            return NOTHING_SUGGESTED
        kept, target = accepted_chars(completion, rest, self.min_chars), len(first_line(rest))
        return CheckResult(kept_share(completion, rest, self.min_chars), f"{kept} of {target} characters of the line kept")
