"""python manage.py train_now --project SLUG [--steps 4] [--batch-size 32] [--lr 1e-5] [--queue] [--as USERNAME]
                             [--agent '{"tasks": 8, "G": 4}']

Starts a training run for the project's lineage and waits for it: in this process by default,
or queued for the Celery train workers with --queue. Prints one line per optimiser step.
"""

from __future__ import annotations

import json
import time

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from feedback.models import Project
from training.models import RunState, TrainingRun
from training.runs.selectors import training_step_list
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings


class Command(BaseCommand):
    help = "Start a training run now (one per project at a time) and wait for it."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--steps", type=int, default=None, help=f"default {RunSettings.steps}")
        parser.add_argument("--batch-size", type=int, default=None, help=f"default {RunSettings.batch_size}")
        parser.add_argument("--lr", type=float, default=None)
        parser.add_argument("--queue", action="store_true", help="run on a Celery train worker, wait here")
        parser.add_argument("--timeout", type=float, default=3600.0)
        parser.add_argument("--agent", default=None, metavar="JSON",
                            help='agent rollouts of the project\'s agent tasks, e.g. \'{"tasks": 8, "G": 4}\'')
        parser.add_argument("--group", default=None, metavar="JSON",
                            help='group rollouts, e.g. \'{"prompts": 32, "G": 8, "max_tokens": 16}\'')
        parser.add_argument("--replay", default=None, metavar="JSON",
                            help='replay rollouts from the corpus (needs --group), e.g. \'{"share": 0.5}\'')
        parser.add_argument("--adapter", default=None, metavar="JSON|lora|full",
                            help='train a LoRA adapter over the frozen base, e.g. lora or '
                                 '\'{"kind": "lora", "rank": 8, "target_modules": ["q_proj", "v_proj"]}\' (default full)')
        parser.add_argument("--as", dest="as_user", default=None, metavar="USERNAME",
                            help="who starts the run (recorded: under the two-person rule they cannot approve "
                                 "its candidate); default the scheduler's service account")

    def handle(self, *args, **opts):

        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}")
        starter = None
        if opts["as_user"]:
            starter = get_user_model().objects.filter(username=opts["as_user"], is_active=True).first()
            if starter is None:
                raise CommandError(f"no active account {opts['as_user']!r}")
        try:
            agent, group, replay = (json.loads(opts[k]) if opts[k] else None for k in ("agent", "group", "replay"))
            adapter = opts["adapter"] if opts["adapter"] in (None, "lora", "full") else json.loads(opts["adapter"])
        except ValueError as exc:
            raise CommandError(f"--agent, --group, --replay or --adapter is not JSON: {exc}") from exc
        given = {"steps": opts["steps"], "batch_size": opts["batch_size"], "agent": agent, "group": group,
                 "replay": replay, "adapter": adapter,
                 "rl": {"lr": opts["lr"]} if opts["lr"] is not None else None}
        try:
            settings = RunSettings.from_dict({k: v for k, v in given.items() if v is not None})
            run, created = training_run_start(project, settings, enqueue=opts["queue"], started_by=starter)
        except ApplicationError as exc:  # a refused setting: say what and how to fix it, no traceback
            raise CommandError(f"{exc.message}. {exc.fix}".strip()) from exc
        if not created:
            raise CommandError(f"run {run.pk} is already {run.state} for {project.slug}; wait for it to end")
        self.stdout.write(f"run {run.pk}: training from v{run.base_version.number}")
        if not opts["queue"]:
            train_policy(run.pk)
        run = self._wait(run.pk, opts["timeout"])
        if run.state != RunState.SUCCEEDED:
            raise CommandError(f"run {run.pk} {run.state}: {run.error}")
        self.stdout.write(self.style.SUCCESS(f"run {run.pk} succeeded: candidate v{run.candidate.number}"))
        c = run.result
        if c.get("agent_rollouts") is not None:
            self.stdout.write(f"  agent: {c['agent_rollouts']} rollouts of {', '.join(c.get('agent_tasks') or [])}, "
                              f"{c.get('agent_turns')} turns, {c.get('agent_tool_calls')} tool calls, "
                              f"{c.get('agent_summaries')} summaries; tests passed {c.get('agent_tests_pass_mean')}, "
                              f"reward {c.get('agent_reward_mean')}")

    def _wait(self, run_id: int, timeout: float):

        shown, deadline = 0, time.monotonic() + timeout
        while True:
            run = TrainingRun.objects.select_related("candidate").get(pk=run_id)
            for step in training_step_list(run)[shown:]:
                self.stdout.write(f"  step {step.step}: loss {step.loss:+.4f} reward {step.reward_mean:+.3f} "
                                  f"kl {step.kl_ref:.4f} clip {step.clip_fraction:.2f} {step.tokens_per_s:,.0f} tok/s")
                shown += 1
            if run.state in (RunState.SUCCEEDED, RunState.FAILED) or time.monotonic() > deadline:
                return run
            time.sleep(1.0)
