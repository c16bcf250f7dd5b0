"""python manage.py revoke_key PREFIX: revoke the API key whose first 11 characters are PREFIX."""

from django.core.management.base import BaseCommand

from feedback.services import api_key_revoke


class Command(BaseCommand):
    help = "Revoke an API key by its prefix (fw_ + 8 characters)."

    def add_arguments(self, parser):
        parser.add_argument("prefix")

    def handle(self, *args, **opts):
        key = api_key_revoke(opts["prefix"][:11])
        self.stdout.write(f"revoked {key.prefix}… of project {key.project.slug}")
