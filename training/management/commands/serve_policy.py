"""python manage.py serve_policy --project SLUG [--port 8001] [--engine vllm|torch] [--model-dir DIR]

Serves what the project should serve (`serving_target`: production, and its canary on a share of
traffic) in the foreground over an OpenAI-compatible HTTP API; every completion is recorded as a
trajectory. Ctrl-C flushes and stops.

It lives in `training` because it knows both sides: the versions (which weights, verified from
the checkpoint store) and the serving process (`inference.serving`), which is handed folders and
never reads versions itself.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import uvicorn
from django.conf import settings
from django.core.asgi import get_asgi_application
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections
from django.urls import clear_url_caches

from core.errors import NotFound
from feedback.models import Project
from feedback.services import feedback_ingest
from inference import metrics, serving
from inference.engine import EngineFactory
from inference.serving import PolicyServer, Recorder, ServingError
from training.versions.selectors import policy_get, serving_target
from training.versions.services import policy_folder

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve a policy over /v1/chat/completions and /v1/completions, recording trajectories."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--engine", choices=["vllm", "torch"], default=os.environ.get("FLYWHEEL_ENGINE", "vllm"))
        parser.add_argument("--model-dir", default=None, help="serve this HF folder instead of the production version")
        parser.add_argument("--policy-version", type=int, default=None, help="serve this version, not production")
        parser.add_argument("--max-model-len", type=int, default=512)
        parser.add_argument("--no-record", action="store_true", help="do not store completions as trajectories")

    def handle(self, *args, **opts):
        server = self._server(opts)
        serving.SERVER = server
        # This process serves the inference URLs only (the dashboard runs in the web process).
        settings.ROOT_URLCONF = "inference.urls"
        clear_url_caches()
        self.stdout.write(f"serving {server.model_name(server.engine.version)} ({opts['engine']}) on "
                          f"http://{opts['host']}:{opts['port']}/v1", ending="\n")
        self.stdout.flush()
        # uvicorn re-raises SIGTERM after its graceful shutdown; with the default action the process
        # would die before the recorder flushes. Raising SystemExit runs the `finally` below.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            uvicorn.run(get_asgi_application(), host=opts["host"], port=opts["port"], log_level="warning")
        finally:
            server.close()
            serving.SERVER = None

    def _server(self, opts) -> PolicyServer:
        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}: create it with manage.py create_project")
        engines = EngineFactory(opts["engine"], {"max_model_len": opts["max_model_len"]})
        resolve = _resolver(project)
        target = serving_target(project.pk)
        try:
            if opts["model_dir"] is not None:
                folder, number = Path(opts["model_dir"]), opts["policy_version"] or 0
            else:
                number = opts["policy_version"] or target.production
                if number is None:
                    raise ServingError(409, f"project {project.slug!r} has no production policy",
                                       "Create one with `manage.py bootstrap_policy --project SLUG`.")
                folder = resolve(number)
            recorder = None if opts["no_record"] else Recorder(write=_writer(project))
            server = PolicyServer(project.slug, engines(folder, number), recorder,
                                  max_model_len=opts["max_model_len"], engines=engines, resolve=resolve)
            if opts["model_dir"] is None and opts["policy_version"] is None and target.canary is not None:
                server.load({"canary": target.canary, "share": target.canary_share})
        except ServingError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from None
        if recorder is not None:
            recorder.start()
        return server


def _resolver(project: Project):
    def resolve(number: int) -> Path:
        close_old_connections()
        version = policy_get(project, number)
        if version is None:
            raise ServingError(404, f"no policy version {number} in project {project.slug!r}", "Check the number.")
        try:
            return policy_folder(version)
        except NotFound as exc:
            raise ServingError(409, exc.message, exc.fix) from None

    return resolve


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def _writer(project: Project):
    def write(events):
        close_old_connections()
        for result in feedback_ingest(project, events):
            if result.status == "rejected":
                metrics.TRAJECTORIES_DROPPED.inc()
                log.error("served completion %s was not recorded: %s", result.id, result.reason)
            else:
                metrics.TRAJECTORIES_RECORDED.inc()

    return write
