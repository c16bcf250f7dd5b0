"""python manage.py simulate_users --project demo --web http://127.0.0.1:8000 [--serving URL] [--serve-key fw_...]
    [--requests N]
    [--taste intent|compiles|one-statement|short-compiles] [--corpus DIR] [--noise 0.05] [--approve]

Simulated users of the demo product (see webapp/demo/simulator.py): they ask the OpenAI-compatible
serving endpoint for completions and send their reactions through the signed webhook. A population
is a taste (which suggestions it accepts: `intent`, what the user was about to type, by default),
a code base (the *.py files under --corpus; by default django's source for `intent`, a code base
the base policy never saw, and the standard library for the line tastes; its held-out files are
never sent) and a random-click rate. With --approve, a service account approves
what passes the gate through the versions API (an admin-scope key: --api-key or
FLYWHEEL_APPROVER_KEY); a person's approval stays the default everywhere else.
"""

from __future__ import annotations

import os
import threading

from django.core.management.base import BaseCommand, CommandError

from feedback.client import FlywheelClient
from webapp.demo.simulator import (
    INTENT,
    POPULATIONS,
    auto_approve,
    code_base,
    django_source,
    run_users,
    stdlib_source,
)


class Command(BaseCommand):
    help = "Ask the serving process for completions and send simulated users' feedback."

    def add_arguments(self, parser):
        parser.add_argument("--project", default="demo")
        parser.add_argument("--web", default="http://127.0.0.1:8000", help="the Flywheel web app (webhook)")
        parser.add_argument("--serving", default=os.environ.get("FLYWHEEL_INFERENCE_URL", "http://127.0.0.1:8001"))
        parser.add_argument("--secret", default=os.environ.get("FLYWHEEL_DEMO_SECRET", ""))
        parser.add_argument("--serve-key", default=os.environ.get("FLYWHEEL_SERVE_KEY", ""),
                            help="an API key with scope 'serve' (or FLYWHEEL_SERVE_KEY); several, comma-separated, "
                                 "give each user its own (serving limits each key's rate)")
        parser.add_argument("--requests", type=int, default=None)
        parser.add_argument("--pause", type=float, default=0.5)
        parser.add_argument("--users", type=int, default=4)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--taste", choices=POPULATIONS, default=os.environ.get("FLYWHEEL_DEMO_TASTE", INTENT))
        parser.add_argument("--corpus", default=os.environ.get("FLYWHEEL_DEMO_CORPUS") or None,
                            help="a folder of *.py files the users write (default: django's source for intent, else the stdlib)")
        parser.add_argument("--noise", type=float, default=0.05, help="share of random clicks")
        parser.add_argument("--approve", action="store_true", help="approve what passes the gate (service account)")
        parser.add_argument("--api-key", default=os.environ.get("FLYWHEEL_APPROVER_KEY", ""))

    def handle(self, *args, **opts):
        if not opts["secret"]:
            raise CommandError("pass --secret whsec_... (the project's webhook secret) or set FLYWHEEL_DEMO_SECRET")
        if not opts["serve_key"]:
            raise CommandError("pass --serve-key fw_... (a key with scope 'serve': manage.py create_key SLUG "
                               "--scopes serve) or set FLYWHEEL_SERVE_KEY")
        if opts["approve"] and not opts["api_key"]:
            raise CommandError("--approve needs an admin-scope key: --api-key or FLYWHEEL_APPROVER_KEY "
                               "(manage.py create_key SLUG --scopes admin,read --name auto-approver)")
        if not 0 <= opts["noise"] <= 1:
            raise CommandError("--noise is a share of clicks in [0, 1]")
        try:
            default = django_source() if opts["taste"] == INTENT else stdlib_source()
            code = code_base(opts["corpus"] or default)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        stop = threading.Event()
        if opts["approve"]:
            threading.Thread(target=auto_approve, args=(opts["web"], opts["api_key"], stop), daemon=True).start()
        sender = FlywheelClient(opts["web"], opts["secret"], project=opts["project"])
        keys = [k.strip() for k in opts["serve_key"].split(",") if k.strip()]
        served = run_users(opts["serving"], sender, opts["project"], code, serve_key=keys,
                           requests=opts["requests"],
                           pause_s=opts["pause"], seed=opts["seed"], users=opts["users"], taste=opts["taste"],
                           noise=opts["noise"])
        stop.set()
        self.stdout.write(f"{served} completions served and reacted to")
