"""python manage.py data_policy --project SLUG [changes] [--reason TEXT] | --opt-out ID | --opt-in ID

Shows a project's data policy (one JSON line), or changes it: --consent-default train|no_train,
--retention-days N|none, --erasure-policy keep|flag|retrain, --redactors email,api_key,ipv4,ipv6
(or "" for none), --custom-patterns '[{"name": "ticket", "pattern": "ACME-[0-9]{6,10}"}]'.
--opt-out / --opt-in put a user on or off the opt-out list. Every change is an AuditLog row
(training.lineage.services.data_policy_update, consent_opt_out_update), by "cli:data_policy"."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from feedback.selectors import project_get
from feedback.userdata.selectors import data_policy_json
from training.lineage.services import consent_opt_out_update, data_policy_update

ACTOR = "cli:data_policy"


class Command(BaseCommand):
    help = "Show or change a project's data policy and opt-out list (audited)."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--consent-default", choices=["train", "no_train"])
        parser.add_argument("--retention-days", help="days, or 'none' to keep raw events for ever")
        parser.add_argument("--erasure-policy", choices=["keep", "flag", "retrain"])
        parser.add_argument("--redactors", help="comma-separated built-in redactors ('' for none)")
        parser.add_argument("--custom-patterns", help="a JSON list of {name, pattern}")
        parser.add_argument("--reason", default="", help="why (kept in the audit log)")
        who = parser.add_mutually_exclusive_group()
        who.add_argument("--opt-out", metavar="USER", help="put the user on the opt-out list")
        who.add_argument("--opt-in", metavar="USER", help="take the user off the opt-out list")

    def handle(self, *args, **opts):
        project = project_get(opts["project"])
        fields = _fields(opts)
        try:
            if opts["opt_out"] or opts["opt_in"]:
                if fields:
                    raise CommandError("give either policy changes or --opt-out/--opt-in, not both")
                before = consent_opt_out_update(project, opts["opt_out"] or opts["opt_in"], bool(opts["opt_out"]),
                                                ACTOR)
                self.stdout.write(json.dumps({"opted_out": bool(opts["opt_out"]), "was_opted_out": before}))
                return
            if fields:
                data_policy_update(project, ACTOR, opts["reason"], **fields)
        except ApplicationError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from exc
        self.stdout.write(json.dumps(data_policy_json(project)))


def _fields(opts) -> dict:
    fields = {name: opts[name] for name in ("consent_default", "erasure_policy") if opts[name] is not None}
    if opts["retention_days"] is not None:
        days = opts["retention_days"]
        if days.lower() != "none" and not days.isdigit():
            raise CommandError(f"--retention-days {days!r}: give a whole number of days, or none")
        fields["retention_days"] = None if days.lower() == "none" else int(days)
    if opts["redactors"] is not None:
        fields["redactors"] = [n.strip() for n in opts["redactors"].split(",") if n.strip()]
    if opts["custom_patterns"] is not None:
        try:
            fields["custom_patterns"] = json.loads(opts["custom_patterns"])
        except ValueError as exc:
            raise CommandError(f"--custom-patterns is not JSON ({exc}): write a list of "
                               '{"name": ..., "pattern": ...}') from exc
    return fields
