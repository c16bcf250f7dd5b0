"""python manage.py create_key SLUG --scopes ingest,read [--name N]: a new API key, printed once."""

from django.core.management.base import BaseCommand

from feedback.selectors import project_get
from feedback.services import api_key_create


class Command(BaseCommand):
    help = "Create an API key for a project with the given scopes (ingest, read, serve, admin)."

    def add_arguments(self, parser):
        parser.add_argument("project")
        parser.add_argument("--scopes", default="ingest")
        parser.add_argument("--name", default="cli")

    def handle(self, *args, **opts):
        raw = api_key_create(project_get(opts["project"]), opts["scopes"].split(","), opts["name"])
        self.stdout.write(raw)
