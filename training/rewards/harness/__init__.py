"""Runs inside the bubblewrap sandbox (`python -I -S /sandbox/harness/main.py ROLE [FD...]`):
never imported by Flywheel. Stdlib only: this folder is the one part of the project the sandbox
can see. checks.py states the design; the roles in short:

    compile    compile the source, never run it; the verdict goes to the result fd (static.py).
    candidate  run prefix + completion under the audit hook (audit.py), send its top-level names,
               then answer the tests' requests (call, attribute, item, operator...) with plain data
               or an opaque handle (candidate.py). Untrusted from the first line of the code on:
               what it sends is only ever a value inside the tests, never a verdict.
    tests      run the test snippet with proxies for the candidate's names, against a pristine
               builtins namespace, and write the verdict to the result fd, which the candidate
               never holds (verdict.py). No candidate code runs there; every frame it receives is
               validated before any test code sees a value, so a malformed one is a fault.
    script     limits, then the code, nothing else: the OS boundary alone (tests of the sandbox).

The config (JSON: code, limits) arrives on stdin, which is read and replaced by /dev/null first.
Wire format between candidate and tests (wire.py): a 4-byte big-endian length, then UTF-8 JSON.
"""
