"""python manage.py create_key SLUG --scopes ingest,read [--name N] [--owner USERNAME | --service-account NAME]:
a new API key, printed once. A key bound to a person or service account acts as them (their role
in the project decides what it may approve; under the two-person rule it counts as them)."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from feedback.selectors import project_get
from feedback.services import api_key_create, service_account_get


class Command(BaseCommand):
    help = "Create an API key for a project with the given scopes (ingest, read, serve, admin)."

    def add_arguments(self, parser):
        parser.add_argument("project")
        parser.add_argument("--scopes", default="ingest")
        parser.add_argument("--name", default="cli")
        owner = parser.add_mutually_exclusive_group()
        owner.add_argument("--owner", help="the username of the person the key acts as")
        owner.add_argument("--service-account", help="the service account the key acts as (service:NAME)")

    def handle(self, *args, **opts):
        owner = None
        if opts["owner"]:
            owner = get_user_model().objects.filter(username=opts["owner"], is_active=True).first()
            if owner is None:
                raise CommandError(f"no active account {opts['owner']!r}")
        elif opts["service_account"]:
            owner = service_account_get(opts["service_account"])
        raw = api_key_create(project_get(opts["project"]), opts["scopes"].split(","), opts["name"], owner=owner)
        self.stdout.write(raw)
