"""python manage.py export_dataset --project SLUG --format {messages,kto,preference}
[--since ISO] [--until ISO] [--version N] [--signal S] [--task T] [--source S] --out FILE.jsonl

Feedback as a JSON Lines dataset for a trainer (formats: feedback/export.py). `--out -` writes to
standard output."""

from __future__ import annotations

import sys
from datetime import datetime

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_datetime

from feedback import export
from feedback.selectors import dataset_rows, project_get


def _when(text: str) -> datetime:
    value = parse_datetime(text)
    if value is None:
        raise CommandError(f"{text!r} is not a date and time; write ISO 8601, e.g. 2026-11-29T08:00:00Z")
    return value


class Command(BaseCommand):
    help = "Export a project's trajectories and feedback as a dataset (messages, kto or preference JSONL)."

    def create_parser(self, prog_name, subcommand, **kwargs):
        # `--version` selects a policy version here (the flag), replacing Django's own.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--format", required=True, choices=export.FORMATS)
        parser.add_argument("--out", required=True, help="FILE.jsonl, or - for standard output")
        parser.add_argument("--since", type=_when, help="trajectories that occurred at or after (ISO 8601)")
        parser.add_argument("--until", type=_when, help="trajectories that occurred before (ISO 8601)")
        parser.add_argument("--version", type=int, dest="policy_version", help="served by this policy version")
        parser.add_argument("--signal", help="only trajectories that received this signal")
        parser.add_argument("--task")
        parser.add_argument("--source", choices=["live", "simulated", "eval"])

    def handle(self, *args, **opts):
        filters = {k: opts[k] for k in ("since", "until", "policy_version", "signal", "task", "source")
                   if opts[k] is not None}
        rows = dataset_rows(project_get(opts["project"]), opts["format"], **filters)
        out = sys.stdout if opts["out"] == "-" else open(opts["out"], "w", encoding="utf-8")  # noqa: SIM115
        count = 0
        try:
            for line in export.jsonl(rows):
                out.write(line)
                count += 1
        finally:
            if out is not sys.stdout:
                out.close()
        self.stderr.write(f"{count} {opts['format']} rows -> {opts['out']}")
