"""python manage.py replica_token http://replica-2:8002

Prints the token of the serving replica that registers at that address (its
FLYWHEEL_REPLICA_TOKEN), derived from this machine's FLYWHEEL_INTERNAL_TOKEN: a replica started
with it, and without the shared token, accepts pushes from the web app and reaches no other replica."""

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.tokens import replica_token


class Command(BaseCommand):
    help = "Print a serving replica's own internal token (FLYWHEEL_REPLICA_TOKEN) for its advertised address."

    def add_arguments(self, parser):
        parser.add_argument("address", help="the URL the replica registers (serve_policy --advertise)")

    def handle(self, *args, **opts):
        if not settings.FLYWHEEL_INTERNAL_TOKEN:
            raise CommandError("FLYWHEEL_INTERNAL_TOKEN is not set here: the replica tokens are derived from it")
        self.stdout.write(replica_token(settings.FLYWHEEL_INTERNAL_TOKEN, opts["address"]))
