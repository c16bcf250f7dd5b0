"""python manage.py simulate_users --project demo --web http://127.0.0.1:8000 [--serving URL] [--requests N]

Simulated users of the demo product (see feedback/simulator.py).
"""

from __future__ import annotations

import os

from django.core.management.base import BaseCommand, CommandError

from feedback.client import FlywheelClient
from training.pretrain import stdlib_corpus
from webapp.demo.simulator import run_users


class Command(BaseCommand):
    help = "Ask the serving process for completions and send simulated users' feedback."

    def add_arguments(self, parser):
        parser.add_argument("--project", default="demo")
        parser.add_argument("--web", default="http://127.0.0.1:8000", help="the Flywheel web app (webhook)")
        parser.add_argument("--serving", default=os.environ.get("FLYWHEEL_INFERENCE_URL", "http://127.0.0.1:8001"))
        parser.add_argument("--secret", default=os.environ.get("FLYWHEEL_DEMO_SECRET", ""))
        parser.add_argument("--requests", type=int, default=None)
        parser.add_argument("--pause", type=float, default=0.5)

    def handle(self, *args, **opts):

        if not opts["secret"]:
            raise CommandError("pass --secret whsec_... (the project's webhook secret) or set FLYWHEEL_DEMO_SECRET")
        sender = FlywheelClient(opts["web"], opts["secret"], project=opts["project"])
        lines = stdlib_corpus(max_lines=20_000)
        served = run_users(opts["serving"], sender, opts["project"], lines, requests=opts["requests"],
                           pause_s=opts["pause"])
        self.stdout.write(f"{served} completions served and reacted to")
