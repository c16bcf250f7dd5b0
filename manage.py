#!/usr/bin/env python
"""Flywheel's command-line interface: `python manage.py help` lists the commands."""

import os
import sys

# Read by torch's OpenMP runtime (libgomp) once, when torch is first imported: so here, first.
# GOMP_SPINCOUNT is libgomp's own default (how long an idle worker thread spins before it sleeps),
# so a process with no more OpenMP threads than cores runs as it would without these. One with
# more (a serving replica: its live engine's team beside its background sampler's, and the
# startup's) is "throttled": libgomp then spins 100 times, shorter than the gap between two of a
# decoder's operators, so every operator woke its threads through the kernel. ACTIVE makes that
# 1,000. Measured (bench/offpeak.py, 2 cores, torch live engine): idle rollouts on the replica
# 0.74 -> 0.875 of a dedicated worker, live p95 0.26 -> 0.19 s. Set either to override. Such
# threads now free their teams when idle (inference/engines/openmp.py), so a replica is throttled
# only while two of them compute at once; these settings stay for that and for other processes.
OPENMP = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}

# A serving replica's own process spins 20,000 times instead (about 2 ms of a core here, against
# 14 ms at 300,000): its background sampler is paused whenever a user arrives, and its idle team
# then spun on the cores the live engine needed. bench/offpeak.py, vLLM live engine, 2 cores: live
# p95 with/without background rollouts 1.138 and 1.161 at 300,000, 1.127 at 20,000 (goal <= 1.15),
# idle rollouts 0.97-1.10 of a dedicated worker either way; torch live engine: 0.845 and 0.814,
# idle 1.04 and 0.87. The processes it starts (vLLM's engine core) keep 300,000, as
# bench/serving.py measured them against `vllm serve`.
SERVING_SPINCOUNT = "20000"


def main() -> None:
    spin_set = "GOMP_SPINCOUNT" in os.environ
    for name, value in OPENMP.items():
        os.environ.setdefault(name, value)
    if sys.argv[1:2] == ["serve_policy"] and not spin_set:
        os.environ["GOMP_SPINCOUNT"] = SERVING_SPINCOUNT
        import torch  # noqa: F401 - libgomp reads its settings when torch loads it, once

        os.environ["GOMP_SPINCOUNT"] = OPENMP["GOMP_SPINCOUNT"]  # for the processes it starts
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
