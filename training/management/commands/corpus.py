"""python manage.py corpus add --project SLUG PATH... [--name NAME] [--heldout-percent 10]
python manage.py corpus list --project SLUG
python manage.py corpus suite --project SLUG [--corpus ID] [--prompts 64]

Registers the project's own code as a corpus (files, folders, globs such as 'src/**/*.py';
`.gitignore`d files, binaries and files over FLYWHEEL_CORPUS_MAX_FILE_BYTES are skipped and
counted), stored content-addressed with a fixed held-out slice; lists the project's corpora; or
makes the project's eval suite (the gate's prompts) of line prefixes of a corpus's held-out files.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from feedback.models import Project
from training.corpora.selectors import corpus_get, corpus_list
from training.corpora.services import DEFAULT_HELDOUT_PERCENT, corpus_add_paths, eval_suite_from_corpus


class Command(BaseCommand):
    help = "Add a corpus (the project's own code) or list the project's corpora."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="add files, folders or globs as a new corpus")
        add.add_argument("--project", required=True)
        add.add_argument("paths", nargs="+", metavar="PATH")
        add.add_argument("--name", default=None)
        add.add_argument("--heldout-percent", type=int, default=DEFAULT_HELDOUT_PERCENT)
        listing = sub.add_parser("list", help="the project's corpora, newest first")
        listing.add_argument("--project", required=True)
        suite = sub.add_parser("suite", help="a new eval suite version of held-out line prefixes")
        suite.add_argument("--project", required=True)
        suite.add_argument("--corpus", type=int, default=None)
        suite.add_argument("--prompts", type=int, default=64)

    def handle(self, *args, **opts):
        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}: create it with manage.py create_project")
        if opts["action"] == "suite":
            try:
                made = eval_suite_from_corpus(corpus_get(project, opts["corpus"]), opts["prompts"])
            except ApplicationError as exc:
                raise CommandError(f"{exc.message}. {exc.fix}".strip()) from None
            self.stdout.write(self.style.SUCCESS(f"eval suite {made.name} v{made.version}: {len(made.prompts)} "
                                                 "held-out line prefixes (the gate's prompts from now on)"))
            return
        if opts["action"] == "list":
            for c in corpus_list(project):
                self.stdout.write(f"corpus {c.pk}: {c.name} — {c.files_count} files, {_tokens(c.tokens)} tokens, "
                                  f"{c.heldout_percent}% held out ({_tokens(c.heldout_tokens)} tokens)")
            return
        try:
            corpus = corpus_add_paths(project, opts["paths"], name=opts["name"], heldout_percent=opts["heldout_percent"])
        except ApplicationError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}".strip()) from None
        held = corpus.files.filter(heldout=True).count()
        self.stdout.write(self.style.SUCCESS(
            f"corpus {corpus.pk}: {corpus.files_count} files ({held} held out), {corpus.bytes:,} bytes, "
            f"{_tokens(corpus.tokens)} tokens; {len(corpus.skipped)} skipped"))
        reasons: dict[str, int] = {}
        for _, why in corpus.skipped:
            reasons[why] = reasons.get(why, 0) + 1
        for why, n in sorted(reasons.items()):
            self.stdout.write(f"  skipped {n}: {why}")


def _tokens(n: int | None) -> str:
    return f"{n:,}" if n is not None else "? (no policy yet)"
