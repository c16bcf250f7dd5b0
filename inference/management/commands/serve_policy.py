"""python manage.py serve_policy --project SLUG [--port 8001] [--engine vllm|torch] [--model-dir DIR]

Serves the project's production policy (or --model-dir) in the foreground over an OpenAI-
compatible HTTP API; every completion is recorded as a trajectory. Ctrl-C flushes and stops.
"""

from __future__ import annotations

import logging
import os
import signal

from django.core.management.base import BaseCommand, CommandError

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
        import uvicorn
        from django.conf import settings
        from django.core.asgi import get_asgi_application
        from django.urls import clear_url_caches

        from inference import serving

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

    def _server(self, opts):
        from feedback.models import Project
        from inference.engine import make_engine
        from inference.serving import PolicyServer, Recorder, ServingError

        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}: create it with manage.py create_project")
        folder, number = opts["model_dir"], opts["policy_version"] or 0
        if folder is None:
            try:
                folder, number = self._version_folder(project, opts["policy_version"])
            except ServingError as exc:
                raise CommandError(f"{exc.message}. {exc.fix}") from None
        engine = make_engine(opts["engine"], folder, version=number, max_model_len=opts["max_model_len"])
        recorder = None if opts["no_record"] else Recorder(write=_writer(project))
        if recorder is not None:
            recorder.start()
        return PolicyServer(project.slug, engine, recorder, max_model_len=opts["max_model_len"])

    def _version_folder(self, project, number):
        from inference.serving import ServingError
        from inference.weights import version_folder
        from training.models import PolicyVersion

        versions = PolicyVersion.objects.filter(project=project)
        version = versions.filter(number=number).first() if number else versions.filter(state="production").order_by(
            "-number").first()
        if version is None:
            raise ServingError(409, f"project {project.slug!r} has no production policy",
                               "Create one with `manage.py bootstrap_policy --project SLUG`.")
        return version_folder(version), version.number


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def _writer(project):
    def write(events):
        from django.db import close_old_connections

        from feedback.services import feedback_ingest

        close_old_connections()
        for result in feedback_ingest(project, events):
            if result.status == "rejected":
                log.error("served completion %s was not recorded: %s", result.id, result.reason)

    return write
