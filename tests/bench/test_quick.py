"""Benches that rot fail here: each bench with a quick mode runs as `--quick --json` (tiny sizes,
seconds) in a subprocess on this session's database server, and its last line must be its JSON
result. No figure is asserted: the bench's numbers are read from its table, by hand.

    .venv/bin/python -m pytest tests/bench/test_quick.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
# The benches with a quick mode (bench/dashboard.py failed unseen for weeks before it had one).
# A quick mode that needs vLLM or TRL's venv leaves that side out and says so in its output.
QUICK = ["dashboard.py", "offpeak.py", "agent_rollouts.py", "broadcast.py", "demo_base.py", "gate_base.py",
         "learning_curve.py",
         "inference.py", "ingest.py", "lineage.py", "midtrain.py", "numerics.py", "reward_model.py", "serving.py", "soak.py",
         # CPU time of each quick mode here (2 cores shared, measured loaded): delta.py 11 s,
         # rehearsal.py 14 s, rl_step.py ~13 s (one bf16 pass, ours only), logprob_cost.py 15 s
         "delta.py", "rehearsal.py", "rl_step.py", "fsdp.py", "logprob_cost.py"]


@pytest.mark.django_db
@pytest.mark.parametrize("bench", QUICK)
def test_a_quick_bench_runs_and_ends_with_its_json_line(bench):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--quick", "--json"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    # A bench that exits 1 for a failed check says why on stdout (its table), a crash on stderr.
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last, done.stdout[-2000:]
