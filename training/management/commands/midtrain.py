"""python manage.py midtrain --project SLUG [--corpus ID] [--steps N | --minutes M] [--from-version N]
                            [--lr 1e-3] [--batch-size 8] [--seq-len 256] [--queue] [--gate] [--as USERNAME]

Mid-trains the project's production policy (or version N) on a corpus's training files (packed
next-token training) and waits for it with a progress bar: in this process by default, or on a
Celery train worker with --queue. Its candidate then goes to the gate like any run's.
"""

from __future__ import annotations

import sys
import time

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from feedback.models import Project
from training.gate.services import gate_run
from training.models import TrainingRun, TrainingStep
from training.runs.services import midtrain_start, train_policy


class Command(BaseCommand):
    help = "Mid-train the production policy on the project's corpus (a candidate version, gated)."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--corpus", type=int, default=None, help="corpus id (default: the newest)")
        budget = parser.add_mutually_exclusive_group()
        budget.add_argument("--steps", type=int, default=None)
        budget.add_argument("--minutes", type=float, default=None)
        parser.add_argument("--from-version", type=int, default=None, help="start from this version, not production")
        parser.add_argument("--lr", type=float, default=None)
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument("--seq-len", type=int, default=None)
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--queue", action="store_true", help="run on a Celery train worker, wait here")
        parser.add_argument("--gate", action="store_true",
                            help="gate the candidate here too and print the report (else a gate worker does)")
        parser.add_argument("--timeout", type=float, default=7 * 24 * 3600.0)
        parser.add_argument("--as", dest="as_user", default=None, metavar="USERNAME",
                            help="who starts the run (the two-person rule: they cannot approve its candidate)")

    def handle(self, *args, **opts):
        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}")
        if opts["steps"] is None and opts["minutes"] is None:
            opts["minutes"] = 5.0
        options = {k: opts[k] for k in ("lr", "batch_size", "seq_len", "seed") if opts[k] is not None}
        try:
            run, created = midtrain_start(project, corpus=opts["corpus"], steps=opts["steps"], minutes=opts["minutes"],
                                          from_version=opts["from_version"], started_by=self._starter(opts["as_user"]),
                                          enqueue=opts["queue"], **options)
        except ApplicationError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}".strip()) from None
        if not created:
            raise CommandError(f"run {run.pk} is already {run.state} for {project.slug}; wait for it to end")
        self.stdout.write(f"run {run.pk}: mid-training v{run.base_version.number} on corpus {run.settings['midtrain']['corpus']}")
        if opts["queue"]:
            run = self._wait(run.pk, opts["timeout"])
        else:
            run = train_policy(run.pk, on_step=lambda r, step, m: _bar(r.settings, step, m))
            sys.stdout.write("\n")
        if run.state != "succeeded":
            raise CommandError(f"run {run.pk} {run.state}: {run.error}")
        c = run.result
        self.stdout.write(self.style.SUCCESS(
            f"run {run.pk} succeeded: candidate v{run.candidate.number} ({c['steps']} steps, loss "
            f"{c['midtrain_loss_first']:.3f} -> {c['midtrain_loss_last']:.3f}, {c['midtrain_tokens_per_s']:,.0f} tokens/s); "
            "the gate (queue `gate`) scores it next; approve it on the registry page once it passed"))
        if opts["gate"]:
            self._gate(run.candidate)

    def _gate(self, candidate) -> None:
        try:
            report = gate_run(candidate.id, actor="system:midtrain")
        except ApplicationError as exc:  # e.g. a gate worker took it first, or no eval suite
            raise CommandError(f"{exc.message}. {exc.fix}".strip()) from None
        for row in report.checks:
            mark = "ok  " if row["passed"] else "FAIL"
            value = f"{row['value']:+.4f}" if isinstance(row["value"], int | float) else "—"
            self.stdout.write(f"  {mark} {row['name']:<28} {value:>10}  {row['detail'][:110]}")
        candidate.refresh_from_db()
        self.stdout.write(f"v{candidate.number}: {candidate.state} (gate report {report.id})")

    def _starter(self, username: str | None):
        if not username:
            return None
        user = get_user_model().objects.filter(username=username, is_active=True).first()
        if user is None:
            raise CommandError(f"no active account {username!r}")
        return user

    def _wait(self, run_id: int, timeout: float) -> TrainingRun:
        deadline = time.monotonic() + timeout
        while True:
            run = TrainingRun.objects.select_related("candidate").get(pk=run_id)
            last = TrainingStep.objects.filter(run_id=run_id).order_by("-step").first()
            if last is not None:
                _bar(run.settings, last.step, {"progress": run.progress, "loss": last.loss,
                                             "tokens_per_s": last.tokens_per_s})
            if run.state in ("succeeded", "failed") or time.monotonic() > deadline:
                sys.stdout.write("\n")
                return run
            time.sleep(0.5)


def _bar(config: dict, step: int, metrics: dict) -> None:
    done = float(metrics.get("progress", 0.0))
    sys.stdout.write(f"\r[{'#' * int(done * 30):<30}] {done:4.0%} step {step + 1} loss {metrics['loss']:.3f} "
                     f"{metrics['tokens_per_s']:,.0f} tok/s")
    sys.stdout.flush()
