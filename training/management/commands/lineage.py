"""python manage.py lineage --project SLUG (--user ID | --trajectory ID | --since ISO [--until ISO])

Which versions learned from a user's data, one trajectory, or what occurred in a time window:
directly (their run trained on it) or through the weights they continue from."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_datetime

from feedback.selectors import project_get
from training.lineage.selectors import lineage_of


def _when(text: str):
    value = parse_datetime(text)
    if value is None or value.tzinfo is None:
        raise CommandError(f"{text!r} is not a date and time with a zone; write ISO 8601, e.g. 2026-11-29T08:00:00Z")
    return value


class Command(BaseCommand):
    help = "Which policy versions learned from a user, a trajectory or a time window."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--user")
        which.add_argument("--trajectory")
        which.add_argument("--since", type=_when)
        parser.add_argument("--until", type=_when)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        if opts["until"] is not None and (opts["user"] or opts["trajectory"]):
            raise CommandError("--until goes with --since (a time window), not with --user or --trajectory")
        which = {k: opts[k] for k in ("user", "trajectory", "since", "until") if opts[k] is not None}
        versions = lineage_of(project_get(opts["project"]), **which)
        if opts["json"]:
            self.stdout.write(json.dumps([v.as_dict() for v in versions]))
            return
        if not versions:
            self.stdout.write("no version learned from it")
        for v in versions:
            how = f"trained on it (runs {', '.join(map(str, v.runs))})" if v.direct else "continues from weights that did"
            self.stdout.write(f"v{v.number} ({v.state}): {how}")
