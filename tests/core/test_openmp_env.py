"""manage.py sets torch's OpenMP wait policy for every command it runs (serve_policy among them),
before Django (and torch with it) is imported; an operator's own values win."""

from __future__ import annotations

import subprocess
import sys

from tests.processes import ROOT, subprocess_env

SHOW = "import os, sys; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"


def _shown(**env: str) -> str:
    inherited = {k: v for k, v in subprocess_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", SHOW], cwd=ROOT, env={**inherited, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_commands_run_with_the_active_wait_policy_and_libgomps_own_spin_count():
    assert _shown() == "ACTIVE 300000"


def test_an_operators_openmp_settings_are_kept():
    assert _shown(OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="1000") == "PASSIVE 1000"
