"""python manage.py agent_tasks --project SLUG [--add DIR ...] [--samples] [--remove NAME] [--list]

Registers the project's agent tasks ("make these tests pass", docs/agents.md): each DIR is one
task named after the folder, its plain files (the code to fix and test_task.py, a tests file of
`assert` lines) and an optional INSTRUCTION.txt (default: "Make the tests in test_task.py pass.").
--samples adds the two built-in sample tasks. Training runs with an `agent` config roll them out;
the gate compares candidate and production on them.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import BadRequest
from feedback.models import Project
from training.models import AgentTask
from training.rewards.services import agent_task_add, agent_task_remove

INSTRUCTION_FILE = "INSTRUCTION.txt"


class Command(BaseCommand):
    help = "Register, list or remove a project's agent tasks (folders of files with a tests file)."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--add", nargs="+", default=[], metavar="DIR", help="task folders to register")
        parser.add_argument("--tests", default="test_task.py", help="the tests file of each added folder")
        parser.add_argument("--samples", action="store_true", help="add the built-in sample tasks")
        parser.add_argument("--remove", nargs="+", default=[], metavar="NAME")
        parser.add_argument("--list", action="store_true")

    def handle(self, *args, **opts):
        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}")
        try:
            for folder in opts["add"]:
                self._add(project, Path(folder), opts["tests"])
            if opts["samples"]:
                from training.rewards.agents import SAMPLE_TASKS

                for t in SAMPLE_TASKS:
                    agent_task_add(project, t.name, dict(t.files), instruction=t.instruction, tests=t.tests)
                    self.stdout.write(f"added {t.name}")
        except BadRequest as exc:
            raise CommandError(f"{exc.message} {exc.fix}") from exc
        for name in opts["remove"]:
            removed = agent_task_remove(project, name)
            self.stdout.write(f"removed {name}" if removed else f"no agent task {name!r}")
        if opts["list"] or not (opts["add"] or opts["samples"] or opts["remove"]):
            for t in AgentTask.objects.filter(project=project).order_by("name"):
                self.stdout.write(f"{t.name}: {len(t.files)} files, tests {t.tests}: {t.instruction}")

    def _add(self, project: Project, folder: Path, tests: str) -> None:
        if not folder.is_dir():
            raise CommandError(f"{folder} is not a folder")
        files = {p.name: p.read_text() for p in sorted(folder.iterdir())
                 if p.is_file() and p.name != INSTRUCTION_FILE and not p.name.startswith(".")}
        instruction = (folder / INSTRUCTION_FILE).read_text() if (folder / INSTRUCTION_FILE).is_file() else ""
        task = agent_task_add(project, folder.name, files, instruction=instruction, tests=tests)
        self.stdout.write(f"added {task.name}: {', '.join(sorted(files))}")
