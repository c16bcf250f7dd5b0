"""python manage.py erase_user --project SLUG --user ID

Erases one user's data (their trajectories, feedback, rewards, rubric scores, quarantine rows and
rows in the export folder) and prints the versions that had learned from it and what the
project's erasure policy (keep | flag | retrain) did about them (retrain: production back to the
newest version that served before and never saw the data, the others that saw it rejected).
Audited without the user's id."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from feedback.selectors import project_get
from training.lineage.services import user_erase


class Command(BaseCommand):
    help = "Erase one user's data from a project and report the versions that learned from it."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--user", required=True, help="the id the events carried in 'user'")
        parser.add_argument("--json", action="store_true", help="print the report as one JSON line")

    def handle(self, *args, **opts):
        report = user_erase(project_get(opts["project"]), opts["user"], "cli:erase_user")
        if opts["json"]:
            self.stdout.write(json.dumps(report.as_dict()))
            return
        removed = ", ".join(f"{k} {v}" for k, v in sorted(report.removed.items()) if v)
        self.stdout.write(f"erasure #{report.erasure}: removed {removed or 'nothing'}; "
                          f"{len(report.export_files)} export file(s) rewritten")
        for v in report.versions:
            how = "trained on it" if v.direct else "continues from weights that did"
            self.stdout.write(f"  v{v.number} ({v.state}): {how}")
        self.stdout.write(f"policy {report.policy}: " + {
            "keep": "the versions are kept as they are",
            "flag": "the versions are flagged on the registry",
            "retrain": "the training lineage continues from the newest version that never saw the data",
        }[report.policy])
        if report.retrain is not None:
            moved = report.retrain
            self.stdout.write(f"  in production: v{moved['production']}" if moved["production"] else
                              "  nothing in production")
            if not moved["production_clean"]:
                self.stdout.write("  WARNING: no version that never saw the data ever served, so production "
                                  "stays; approve a new candidate trained without it")
            for key in ("retired", "rejected"):
                if moved[key]:
                    self.stdout.write(f"  {key}: " + ", ".join(f"v{n}" for n in moved[key]))
