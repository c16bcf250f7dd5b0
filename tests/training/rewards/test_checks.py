"""Verifiable checks, including hostile completions: each scores 0 with a reason, caller unharmed.

    .venv/bin/python -m pytest tests/training/rewards/test_checks.py -q
"""

import os

import pytest

from training.rewards.checks import CHECKS, CheckConfigError, CheckResult, make_check

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
LIMITS = {"cpu_s": 1, "wall_s": 3.0, "memory_mb": 256}


def run_tests(completion: str, prefix: str = "", **limits) -> CheckResult:
    return make_check("python_tests", tests=TESTS, **{**LIMITS, **limits}).run(completion, {"prefix": prefix})


def test_a_correct_completion_passes_and_the_prefix_is_prepended():
    assert run_tests("    return a + b\n", prefix="def add(a, b):\n") == CheckResult(1.0, "all tests passed")


def test_a_wrong_completion_fails_with_the_failing_line():
    result = run_tests("def add(a, b):\n    return a - b\n")
    assert result.score == 0.0 and result.reason.startswith("AssertionError at tests.py:1")


def test_writing_inside_the_sandbox_directory_is_allowed():
    code = "open('scratch.txt', 'w').write('ok')\ndef add(a, b):\n    return a + b\n"
    assert run_tests(code).passed


HOSTILE = {
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "forbidden operation: os.fork"),
    "subprocess": ("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", "forbidden operation: import"),
    "multiprocessing": ("import multiprocessing\n", "forbidden operation: import multiprocessing"),
    "os.system": ("import os\nos.system('echo hi')\n", "forbidden operation: os.system"),
    "infinite loop": ("while True:\n    pass\n", "CPU time limit exceeded"),
    "sleeps forever": ("import time\ntime.sleep(60)\n", "wall-clock limit exceeded"),
    "1 GB allocation": ("x = bytearray(1 << 30)\n", "memory limit exceeded"),
    "network": ("import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n", "forbidden operation: socket"),
    "ctypes": ("import ctypes\n", "forbidden operation: import ctypes"),
    "early exit": ("import sys\nsys.exit(0)\n", "exited early"),
    "hard exit": ("import os\nos._exit(0)\n", "without a result"),
    # Nothing reads a file the code writes: the run goes on, and the tests fail on their own terms.
    "forged result": ("print('all tests passed')\nopen('result.json', 'w').write('{\"ok\": true}')\n",
                      "name 'add' is not defined"),
    "output flood": ("while True:\n    print('x' * 10000)\n", "limit exceeded"),
    "big file": ("open('big', 'wb').write(bytes(2 << 20))\n", "file size limit exceeded"),
    "swallowed violation": ("import os\ntry:\n    os.fork()\nexcept Exception:\n    pass\n"
                            "def add(a, b):\n    return a + b\n", "forbidden operation: os.fork"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_completion_scores_zero_with_a_reason(name):
    code, reason = HOSTILE[name]
    # The CPU limit must be met before the wall clock, however loaded the machine: a second of CPU
    # can take longer than 3 s of wall time on shared cores.
    result = run_tests(code, **({"wall_s": 60.0} if reason.startswith("CPU") else {}))
    assert result.score == 0.0
    assert reason in result.reason, result.reason


def test_file_writes_outside_the_sandbox_are_refused(tmp_path):
    target = tmp_path / "pwned.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')\n", f"import os\nos.remove({str(tmp_path / 'keep')!r})\n",
                 f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')\n"):
        (tmp_path / "keep").write_text("keep")
        result = run_tests(code + "def add(a, b):\n    return a + b\n")
        assert result.score == 0.0 and "forbidden operation" in result.reason
    assert not target.exists() and (tmp_path / "keep").read_text() == "keep"


def test_the_caller_is_untouched_after_hostile_runs():
    cwd, pid = os.getcwd(), os.getpid()
    run_tests("import os\nos.chdir('/')\nos.kill(os.getppid(), 9)\n")
    assert os.getcwd() == cwd and os.getpid() == pid  # and we are still alive to say so


def test_python_compiles_checks_syntax_only():
    check = make_check("python_compiles", **LIMITS)
    assert check.run("def f(x):\n    return x\n").passed
    assert check.run("import os\nos.fork()\n").passed  # compiled, never executed
    bad = check.run("def f(:\n")
    assert bad.score == 0.0 and bad.reason.startswith("syntax error")
    deep = check.run("x = " + "[" * 5000 + "]" * 5000)
    assert deep.score == 0.0 and "syntax error" in deep.reason


def test_the_registry_builds_checks_by_name_and_refuses_bad_config():
    assert {"python_compiles", "python_tests"} <= set(CHECKS)
    with pytest.raises(CheckConfigError, match="unknown check"):
        make_check("nope")
    with pytest.raises(CheckConfigError, match="test snippet"):
        make_check("python_tests").run("x = 1")


def test_compiling_many_in_one_sandbox_gives_each_its_own_verdict() -> None:
    check = make_check("python_compiles", **LIMITS)
    items = [(" return a + b", {"prefix": "def add(a, b):\n"}), ("x = (1 +", None), ("y = 2", None),
             ("eval('1')" * 2, None)]
    one_by_one = [check.run(c, ctx) for c, ctx in items]
    assert [r.score for r in check.run_many(items)] == [r.score for r in one_by_one] == [1.0, 0.0, 1.0, 0.0]
    assert check.run_many(items)[1].reason == one_by_one[1].reason


def test_an_empty_suggestion_verifies_nothing_even_after_a_prefix_that_compiles() -> None:
    check = make_check("python_compiles", prompt_is_prefix=True, **LIMITS)
    items = [("", {"prompt": "import os"}), (" \n", {"prompt": "x = 1"}), ("\nx = 2", {"prompt": "import os"})]
    assert [r.score for r in check.run_many(items)] == [0.0, 0.0, 1.0]
    assert check.run("", {"prompt": "import os"}).reason == "empty completion: nothing to verify"
