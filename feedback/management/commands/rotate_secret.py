"""python manage.py rotate_secret SLUG [--grace-hours H]: a new webhook secret; the old one lasts H hours."""

import json
from datetime import timedelta

from django.core.management.base import BaseCommand

from feedback.selectors import project_get
from feedback.services import webhook_secret_rotate


class Command(BaseCommand):
    help = "Rotate a project's webhook secret (old and new both verify during the grace period)."

    def add_arguments(self, parser):
        parser.add_argument("project")
        parser.add_argument("--grace-hours", type=float, default=24.0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        secret = webhook_secret_rotate(project_get(opts["project"]), timedelta(hours=opts["grace_hours"]))
        if opts["json"]:
            self.stdout.write(json.dumps({"webhook_secret": secret.secret}))
        else:
            self.stdout.write(f"webhook_secret: {secret.secret}")
