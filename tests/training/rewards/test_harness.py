"""The harness cannot be talked into a pass: each case is a reward a policy could learn to collect.

A completion here is wrong (or answers nothing) unless the attack worked, so a pass would mean
the harness was fooled. "Forged" completions take the protocol over entirely (they find the
pipes by walking the frames up to the harness and write raw frames), the strongest candidate.

    .venv/bin/python -m pytest tests/training/rewards/test_harness.py -q
"""

import json
import platform
import struct

import pytest

from training.rewards import sandbox
from training.rewards.checks import CheckConfigError, CheckResult, make_check
from training.rewards.sandbox import SandboxLimits, run_script

LIMITS = {"cpu_s": 2, "wall_s": 10.0, "memory_mb": 256}


def check(completion: str, tests: str) -> CheckResult:
    return make_check("python_tests", tests=tests, **LIMITS).run(completion)


def compiles(completion: str, prefix: str = "") -> CheckResult:
    return make_check("python_compiles", **LIMITS).run(completion, {"prefix": prefix})


# ---------------------------------------------------------------------------------- builtins

SHADOWED = {  # builtin the tests lean on: (the candidate's wrong code, the tests)
    "all": ("all = lambda xs: True\ndef is_even(n):\n    return False\n",
            "assert all([is_even(2), is_even(4)])\n"),
    "any": ("def any(xs):\n    return False\ndef is_even(n):\n    return True\n",
            "assert not any([is_even(1), is_even(3)])\n"),
    "sum": ("sum = lambda xs: 6\ndef add(a, b):\n    return 0\n", "assert sum([add(1, 1), add(2, 2)]) == 6\n"),
    "abs": ("abs = lambda x: 0\ndef area(r):\n    return 0\n", "assert abs(area(1) - 3.14159) < 1e-3\n"),
    "len": ("len = lambda x: 2\ndef evens(n):\n    return []\n", "assert len(evens(4)) == 2\n"),
    "sorted": ("sorted = lambda xs: [1, 3]\ndef uniq(xs):\n    return xs\n",
               "assert sorted(uniq([3, 1, 3])) == [1, 3]\n"),
    "range": ("range = lambda *a: []\ndef is_even(n):\n    return False\n",
              "for n in range(5):\n    assert is_even(2 * n)\n"),
    "list": ("list = lambda xs: [0, 2, 4]\ndef evens(n):\n    return iter([1])\n",
             "assert list(evens(5)) == [0, 2, 4]\n"),
}


@pytest.mark.parametrize("name", sorted(SHADOWED))
def test_a_candidate_defining_a_builtin_does_not_change_what_the_tests_call(name):
    code, tests = SHADOWED[name]
    result = check(code, tests)
    assert result.score == 0.0, result.reason


def test_a_correct_completion_with_a_helper_named_like_a_builtin_still_passes():
    code = "def all(xs):\n    return False\ndef is_even(n):\n    return n % 2 == 0\n"
    assert check(code, "assert all(map(is_even, [2, 4]))\nassert not is_even(3)\n").passed


# ---------------------------------------------------------------------------------- non-finite numbers

TOL_TESTS = "got = area(1)\nif abs(got - 3.14159) > 1e-3:\n    raise AssertionError(f'area(1) = {got}')\n"
LIST_TOL_TESTS = ("for got, want in zip(areas(), [3.14159, 12.566]):\n    if abs(got - want) > 1e-3:\n"
                  "        raise AssertionError('wrong area')\n")


@pytest.mark.parametrize("value", ["float('nan')", "float('inf') - float('inf')", "float('-inf')",
                                   "complex(float('nan'), 0)"])
def test_a_non_finite_answer_fails_a_tolerance_test(value):
    result = check(f"def area(r):\n    return {value}\n", TOL_TESTS)
    assert result.score == 0.0 and "non-finite" in result.reason, result.reason


def test_a_nan_inside_a_list_fails_too():
    result = check("def areas():\n    return [float('nan'), float('nan')]\n", LIST_TOL_TESTS)
    assert result.score == 0.0 and "non-finite" in result.reason, result.reason


def test_the_tests_may_still_pass_infinities_to_the_candidate():
    code = "import math\ndef is_big(x):\n    return math.isinf(x)\n"
    assert check(code, "assert is_big(float('inf')) and not is_big(1.0)\n").passed


# ---------------------------------------------------------------------------------- forged frames

FORGER = """
import os, sys
frame, pipes = sys._getframe(), {{}}
while frame is not None:
    pipes.update({{k: v for k, v in frame.f_locals.items() if k in ("replies", "requests")}})
    frame = frame.f_back

def put(data):
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(pipes["replies"], data):]

put(b'{{"ready":[["area",{{"h":1,"r":"function"}}]],"x":[]}}')
answers, n = {answers}, 0
while len(head := os.read(pipes["requests"], 4)) == 4:
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        body += os.read(pipes["requests"], size - len(body))
    put(answers[min(n, len(answers) - 1)])
    n += 1
os._exit(0)
"""
# Passes if the call raises anything at all: an exception raised while reading a reply would do.
RAISES_TESTS = ("try:\n    area(-1)\nexcept Exception:\n    pass\nelse:\n"
                "    raise AssertionError('no error for a negative radius')\n")
DEEP = "[b'{\"v\":' + b'[' * 100_000 + b']' * 100_000 + b',\"x\":[]}']"  # built inside
FORGED = {  # name: (raw reply frames, answered in turn, the last one repeated; the tests)
    "NaN literal": ([b'{"v":NaN,"x":[]}'], TOL_TESTS),
    "overflowing float literal": ([b'{"v":1e400,"x":[]}'], TOL_TESTS),
    "tagged nan": ([b'{"v":{"f":"nan"},"x":[]}'], TOL_TESTS),
    "frame nested past the recursion limit": (DEEP, RAISES_TESTS),
    "error with an unhashable class id": (
        [b'{"e":"ValueError","m":"","exc":["ValueError","Exception"],"w":"","c":[1],"x":[]}'], RAISES_TESTS),
    "error with a non-list mro": ([b'{"e":"ValueError","m":"","exc":7,"w":"","c":null,"x":[]}'], RAISES_TESTS),
    "error with a non-string message": (
        [b'{"e":"ValueError","m":{"a":1},"exc":["ValueError","Exception"],"w":"","x":[]}'], RAISES_TESTS),
    "violations that are not a list": ([b'{"v":1,"x":5}'], RAISES_TESTS),
    "a handle with a non-integer id": ([b'{"v":{"h":[1],"r":"x"},"x":[]}'], RAISES_TESTS),
    "len answering a string": ([b'{"v":{"h":2,"r":"Box"},"x":[]}', b'{"v":"3","x":[]}'],
                               "try:\n    n = len(area(1))\nexcept Exception:\n    n = 3\nassert n == 3\n"),
    "iter answering a list": ([b'{"v":{"h":2,"r":"Box"},"x":[]}', b'{"v":[1],"x":[]}'],
                              "try:\n    got = list(area(1))\nexcept Exception:\n    got = [1]\n"
                              "assert got == [1]\n"),
    "a value that is not JSON": ([b'{"v":[1,2', b'{"v":1}'], RAISES_TESTS),
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_malformed_reply_is_a_fault_not_an_exception_the_tests_can_swallow(name):
    answers, tests = FORGED[name]
    result = check(FORGER.format(answers=answers if isinstance(answers, str) else repr(answers)), tests)
    assert result.score == 0.0, result.reason
    assert "broke the protocol" in result.reason or "non-finite" in result.reason, result.reason


def test_the_forger_is_a_working_candidate_when_it_answers_well():
    """The forgeries above fail for what they send, not for how: the same forger, answering plain
    values, passes."""
    assert check(FORGER.format(answers=repr([b'{"v":3.14159,"x":[]}'])), TOL_TESTS).passed


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "raise SystemExit(0)", "raise KeyboardInterrupt"])
def test_exiting_during_a_call_is_a_fault_even_under_except_exception(exit_call):
    result = check(f"import sys\ndef area(r):\n    {exit_call}\n", RAISES_TESTS)
    assert result.score == 0.0 and "during the tests" in result.reason, result.reason


def test_a_raised_error_still_reaches_the_tests_except():
    assert check("def area(r):\n    raise ValueError('negative')\n", RAISES_TESTS).passed


EQ_LIARS = {
    "int": "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
    "str": "class Liar(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n",
    "float": "class Liar(float):\n    def __eq__(self, other):\n        return True\n"
             "    def __gt__(self, other):\n        return False\n    __hash__ = float.__hash__\n",
    "list": "class Liar(list):\n    def __eq__(self, other):\n        return True\n",
    "dict": "class Liar(dict):\n    def __eq__(self, other):\n        return True\n",
}


@pytest.mark.parametrize("base", sorted(EQ_LIARS))
def test_a_subclass_of_plain_data_that_lies_about_equality_arrives_as_plain_data(base):
    code = EQ_LIARS[base] + "def add(a, b):\n    return Liar()\n"
    result = check(code, "assert add(2, 3) == 5\nassert not (add(2, 3) > 5)\n")
    assert result.score == 0.0, result.reason


def test_a_reply_too_large_to_send_ends_the_candidate_and_fails():
    result = check("def area(r):\n    return 'x' * (5 << 20)\n", RAISES_TESTS)
    assert result.score == 0.0, result.reason


def test_printing_the_harness_frames_and_verdict_on_stdout_forges_nothing():
    verdict = json.dumps({"ok": True, "reason": "all tests passed", "gone": False})
    code = (f"import sys\nframe = {verdict!r}.encode()\n"
            "for out in (sys.stdout.buffer, sys.stderr.buffer):\n"
            "    out.write(len(frame).to_bytes(4, 'big') + frame + frame + b'\\n')\n    out.flush()\n"
            "def add(a, b):\n    return a - b\n")
    result = check(code, "assert add(2, 3) == 5\n")
    assert result.score == 0.0 and result.reason.startswith("AssertionError"), result.reason


# ---------------------------------------------------------------------------------- blank tests, empty code


@pytest.mark.parametrize("tests", ["   \n\t\n", "# assert add(1, 2) == 3\n", '"""add adds."""\n', "pass\n",
                                   "\n# one\n\n...\n"])
def test_a_test_snippet_that_tests_nothing_is_refused(tests):
    with pytest.raises(CheckConfigError, match="test snippet"):
        check("def add(a, b):\n    return a - b\n", tests)


@pytest.mark.parametrize("completion", ["# return a + b\n", '    """Adds a and b."""\n', "    pass\n",
                                        "\n    # TODO\n    ...\n"])
def test_a_completion_of_only_comments_or_docstrings_does_not_compile_to_a_pass(completion):
    prefix = "def add(a, b):\n    return a + b\n" if completion.startswith("#") else "def add(a, b):\n"
    result = compiles(completion, prefix)
    assert result.score == 0.0 and "adds no code" in result.reason, result.reason
    [batched] = make_check("python_compiles", **LIMITS).run_many([(completion, {"prefix": prefix})])
    assert batched == result


@pytest.mark.parametrize(("prefix", "completion"), [
    ("def add(a, b):\n", "    return a + b\n"), ("x = ", '"abc"\n'), ('"""Module."""\n', "x = 1  # one\n"),
    ("def add(a, b):\n    ", '"""Adds."""\n    return a + b\n'), ("", "print('hi')\n"),
])
def test_a_completion_that_adds_code_still_compiles(prefix, completion):
    assert compiles(completion, prefix) == CheckResult(1.0, "compiles")


# ---------------------------------------------------------------------------------- dir_fd, sockets

DIR_FD_WRITES = {
    "mkdir": "os.mkdir('pwned', dir_fd=fd)",
    "open": "os.close(os.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
    "rename": "os.rename('a', 'b', src_dir_fd=fd, dst_dir_fd=fd)",
    "symlink": "os.symlink('/sandbox/work/x', 'pwned', dir_fd=fd)",
}


@pytest.mark.parametrize("name", sorted(DIR_FD_WRITES))
def test_a_write_relative_to_a_directory_fd_outside_is_a_violation(name):
    code = (f"import os\nfd = os.open('/usr', os.O_RDONLY)\ntry:\n    {DIR_FD_WRITES[name]}\n"
            "except OSError:\n    pass\ndef add(a, b):\n    return a + b\n")
    result = check(code, "assert add(2, 3) == 5\n")
    assert result.score == 0.0 and "forbidden operation" in result.reason, result.reason


def test_a_write_relative_to_a_directory_fd_inside_is_allowed():
    code = ("import os\nos.mkdir('sub')\nfd = os.open('sub', os.O_RDONLY)\nos.mkdir('deeper', dir_fd=fd)\n"
            "os.close(os.open('f', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n"
            "def add(a, b):\n    return a + b\n")
    assert check(code, "assert add(2, 3) == 5\n").passed


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="seccomp filters those two")
def test_only_unix_and_inet_sockets_can_be_created():
    out = run_script("""
import socket
for name in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET", "AF_UNIX", "AF_INET", "AF_INET6"):
    kind = socket.SOCK_RAW if name in ("AF_NETLINK", "AF_PACKET") else socket.SOCK_STREAM
    try:
        socket.socket(getattr(socket, name), kind).close()
        print(name, "created")
    except OSError as exc:
        print(name, exc.errno)
a, b = socket.socketpair()
print("socketpair", a.family.name)
""", SandboxLimits(**LIMITS)).output
    for name in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET"):
        assert f"{name} 97" in out, out  # EAFNOSUPPORT from the filter
    for name in ("AF_UNIX", "AF_INET", "AF_INET6"):
        assert f"{name} created" in out, out
    assert "socketpair AF_UNIX" in out


def _run_filter(program: bytes, arch: int, nr: int, arg0: int) -> int:
    """A classic-BPF interpreter for the instructions seccomp_program uses, over a seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x06:
            return k
        if code == 0x20:
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
            continue
        taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
        pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize(("machine", "arch", "socket_nr", "socketpair_nr"),
                         [("x86_64", 0xC000003E, 41, 53), ("aarch64", 0xC00000B7, 198, 199)])
def test_the_seccomp_filter_answers_socket_families_it_does_not_need_with_eafnosupport(
        machine, arch, socket_nr, socketpair_nr):
    program = sandbox.seccomp_program(machine)
    for nr in (socket_nr, socketpair_nr):
        for family in (40, 16, 17, 38, 0):  # vsock, netlink, packet, alg, unspec
            assert _run_filter(program, arch, nr, family) == 0x00050000 | 97, (nr, family)
        for family in (1, 2, 10):
            assert _run_filter(program, arch, nr, family) == 0x7FFF0000, (nr, family)
    assert _run_filter(program, arch, 0 if machine == "x86_64" else 63, 40) == 0x7FFF0000  # read(40, ...)
