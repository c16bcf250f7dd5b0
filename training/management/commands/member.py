"""python manage.py member SLUG USERNAME viewer|approver|admin|none [--reason TEXT]

Gives an account a role in one project (none: removes it), audited as `system:cli`. Service
accounts are named `service:NAME` (created here when missing)."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from feedback.models import SERVICE_ACCOUNT_PREFIX
from feedback.selectors import project_get
from feedback.services import service_account_get
from training.promotion.services import membership_grant


class Command(BaseCommand):
    help = "Give a person or service account a role (viewer, approver, admin) in a project, or remove it (none)."

    def add_arguments(self, parser):
        parser.add_argument("project")
        parser.add_argument("username")
        parser.add_argument("role", choices=["viewer", "approver", "admin", "none"])
        parser.add_argument("--reason", default="")

    def handle(self, *args, **opts):
        name = opts["username"]
        try:
            project = project_get(opts["project"])
            if name.startswith(SERVICE_ACCOUNT_PREFIX):
                user = service_account_get(name[len(SERVICE_ACCOUNT_PREFIX):])
            else:
                user = get_user_model().objects.filter(username=name).first()
                if user is None:
                    raise CommandError(f"no account {name!r}")
            role = None if opts["role"] == "none" else opts["role"]
            before = membership_grant(project, user, role, "system:cli", opts["reason"])
        except ApplicationError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from exc
        self.stdout.write(f"{user.get_username()} in {project.slug}: {before or 'none'} -> {role or 'none'}")
