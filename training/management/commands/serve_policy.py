"""python manage.py serve_policy --project SLUG [--port 8001] [--internal-port 8002] [--engine vllm|torch]
    [--model-dir DIR] [--serial]

With --engine vllm, requests run on vLLM's async engine: concurrent requests share its batches
(continuous batching) and a weight swap waits for the requests in flight. --serial runs them one
at a time on the in-process vLLM engine instead (the reference the serving bench compares with);
the torch engine always runs one at a time.

Serves what the project should serve (`serving_target`: production, and its canary on a share of
traffic) in the foreground over an OpenAI-compatible HTTP API (bearer keys of scope `serve`);
every completion is recorded as a trajectory. Ctrl-C flushes and stops.

/internal/load listens on its own port on loopback (default: the public port + 1) and loads only
what the database says the project serves: production, or the running canary.

It lives in `training` because it knows both sides: the versions (which weights, verified from
the checkpoint store) and the serving process (`inference.serving`), which is handed folders and
never reads versions itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError, close_old_connections

from core.errors import NotFound
from feedback.models import Project
from feedback.services import feedback_ingest, quarantine_record
from inference import metrics, serving
from inference.engine import EngineFactory
from inference.listeners import serve_both
from inference.serving import PolicyServer, Recorder, ServingError
from kernels.delta import CheckpointCorrupt
from training.versions.selectors import policy_get, serving_target
from training.versions.services import policy_folder

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve a policy over /v1/chat/completions and /v1/completions, recording trajectories."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--internal-port", type=int, default=None,
                            help="loopback port of /internal/load (default: --port + 1)")
        parser.add_argument("--engine", choices=["vllm", "torch"], default=os.environ.get("FLYWHEEL_ENGINE", "vllm"))
        parser.add_argument("--model-dir", default=None, help="serve this HF folder instead of the production version")
        parser.add_argument("--policy-version", type=int, default=None, help="serve this version, not production")
        parser.add_argument("--max-model-len", type=int, default=512)
        parser.add_argument("--no-record", action="store_true", help="do not store completions as trajectories")
        parser.add_argument("--serial", action="store_true",
                            help="vllm: one request at a time on the in-process engine (no batching across requests)")

    def handle(self, *args, **opts):
        server = self._server(opts)
        serving.SERVER = server
        internal_port = opts["internal_port"] or opts["port"] + 1
        self.stdout.write(f"serving {server.model_name(server.engine.version)} ({opts['engine']}) on "
                          f"http://{opts['host']}:{opts['port']}/v1 (internal: 127.0.0.1:{internal_port})",
                          ending="\n")
        self.stdout.flush()
        # uvicorn re-raises SIGTERM after its graceful shutdown; with the default action the process
        # would die before the recorder flushes. Raising SystemExit runs the `finally` below.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            asyncio.run(serve_both(opts["host"], opts["port"], "127.0.0.1", internal_port))
        finally:
            server.close()
            serving.SERVER = None

    def _server(self, opts) -> PolicyServer:
        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}: create it with manage.py create_project")
        engines = EngineFactory(engine_kind(opts["engine"], opts["serial"]), {"max_model_len": opts["max_model_len"]})
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
                folder = resolve(number, "start")
            recorder = None if opts["no_record"] else recorder_for(project)
            server = PolicyServer(project.slug, engines(folder, number), recorder,
                                  max_model_len=opts["max_model_len"], engines=engines,
                                  resolve=_servable(project, resolve))
            if opts["model_dir"] is None and opts["policy_version"] is None and target.canary is not None:
                server.load({"canary": target.canary, "share": target.canary_share})
        except ServingError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from None
        if recorder is not None:
            recorder.start()
        return server


def engine_kind(engine: str, serial: bool) -> str:
    """The engine the serving process runs: vLLM batches concurrent requests unless --serial."""
    return "vllm-async" if engine == "vllm" and not serial else engine


def _resolver(project: Project):
    def resolve(number: int, role: str) -> Path:
        close_old_connections()
        version = policy_get(project, number)
        if version is None:
            raise ServingError(404, f"no policy version {number} in project {project.slug!r}", "Check the number.")
        try:
            return policy_folder(version)
        except NotFound as exc:
            raise ServingError(409, exc.message, exc.fix) from None
        except CheckpointCorrupt as exc:  # nothing was loaded: the served version stays
            raise ServingError(409, f"policy v{number}'s checkpoint is refused: {exc}",
                               "Nothing was swapped; train a new candidate or restore the store's files.") from None
        except OSError as exc:  # e.g. no space left to materialise it
            raise ServingError(507, f"policy v{number} could not be written out for loading: {exc}",
                               "Nothing was swapped; free space under FLYWHEEL_VAR_DIR and send the load again.") from None

    return resolve


def _servable(project: Project, resolve):
    """The resolver /internal/load goes through: only the version the database says the project
    serves in that role (production, or the running canary) is loaded, whatever the caller asks."""

    def servable(number: int, role: str) -> Path:
        close_old_connections()
        target = serving_target(project.pk)
        wanted = target.production if role == "production" else target.canary
        if number != wanted:
            version = policy_get(project, number)
            state = version.state if version is not None else "unknown"
            raise ServingError(409, f"v{number} is {state}, not the project's {role} (that is v{wanted})",
                               "Promote it or start its canary first (dashboard or the versions API); the "
                               "deploy then loads it.")
        return resolve(number, role)

    return servable


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def recorder_for(project: Project) -> Recorder:
    """The serving process's recorder: writes through `feedback_ingest`; a completion that is
    rejected, or whose write raises for any reason but the database being away, is quarantined."""

    def quarantine(event: dict[str, Any], error: str) -> None:
        ident = event.get("id") if isinstance(event, dict) else None
        quarantine_record(project.pk, "serving", f"trajectory {str(ident)[:200]}", error,
                          detail={"policy_version": event.get("policy_version") if isinstance(event, dict) else None})

    def write(events: list[dict[str, Any]]) -> None:
        close_old_connections()
        for result in feedback_ingest(project, events):
            if result.status == "rejected":
                metrics.TRAJECTORIES_DROPPED.inc()
                log.error("served completion %s was not recorded: %s", result.id, result.reason)
                quarantine(events[result.index], f"rejected by ingest: {result.reason}")
            else:
                metrics.TRAJECTORIES_RECORDED.inc()

    return Recorder(write=write, quarantine=quarantine, transient=_database_away)


def _database_away(exc: Exception) -> bool:
    return isinstance(exc, OperationalError | InterfaceError)
