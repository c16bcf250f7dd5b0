"""`manage.py migrate`, as the schema's owner: Django's migrate, connected with DATABASE_OWNER_URL's
role, then the application's role (DATABASE_URL's) is granted what it may do (webapp/db_roles.py).
With one role for both (DATABASE_OWNER_URL unset) this is Django's migrate unchanged."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import CommandError
from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import DEFAULT_DB_ALIAS, connections

from core.env import ConfigError
from webapp.db_roles import grant_app_role

# What selects the role; NAME stays the connection's own (the test runner renames it).
_LOGIN = ("USER", "PASSWORD", "HOST", "PORT")


class Command(DjangoMigrate):
    help = DjangoMigrate.help + " Runs as the schema owner (DATABASE_OWNER_URL), then grants DATABASE_URL's role."

    def handle(self, *args, **options):
        conn = connections[options["database"]]
        owner = settings.DATABASE_OWNER
        app_role = conn.settings_dict["USER"]
        if options["database"] != DEFAULT_DB_ALIAS or owner["USER"] == app_role:
            return super().handle(*args, **options)
        saved = {key: conn.settings_dict[key] for key in _LOGIN}
        conn.close()
        conn.settings_dict.update({key: owner[key] for key in _LOGIN})
        try:
            super().handle(*args, **options)
            grant_app_role(app_role, using=options["database"])
        except ConfigError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            # The application's own connection again, from the next query on.
            conn.close()
            conn.settings_dict.update(saved)
        if options["verbosity"] >= 1:
            self.stdout.write(f"Granted role {app_role!r} rows, and only INSERT and SELECT on the audit log.")
