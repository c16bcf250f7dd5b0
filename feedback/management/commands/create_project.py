"""python manage.py create_project NAME [--slug S] [--json]: a project, an API key and a webhook secret."""

import json

from django.core.management.base import BaseCommand

from feedback.services import project_create


class Command(BaseCommand):
    help = "Create a project; print its API key and webhook secret (shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--slug", default=None)
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args, **opts):
        creds = project_create(opts["name"], opts["slug"])
        out = {"project": creds.project.slug, "api_key": creds.api_key, "webhook_secret": creds.webhook_secret}
        if opts["json"]:
            self.stdout.write(json.dumps(out))
            return
        for key, value in out.items():
            self.stdout.write(f"{key}: {value}")
        self.stdout.write("Keep the key and secret now: they are not shown again.")
