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
# 0.74 -> 0.875 of a dedicated worker, live p95 0.26 -> 0.19 s. Set either to override.
OPENMP = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def main() -> None:
    for name, value in OPENMP.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
