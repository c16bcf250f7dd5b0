"""python manage.py serve_policy --project SLUG [--port 8001] [--internal-port 8002] [--engine vllm|torch]
    [--internal-host 127.0.0.1] [--advertise URL] [--model-dir DIR] [--serial] [--summary-budget TOKENS]
    [--background-rollouts K]

With --engine vllm, requests run on vLLM's async engine: concurrent requests share its batches
(continuous batching) and a weight swap waits for the requests in flight. --serial runs them one
at a time on the in-process vLLM engine instead (the reference the serving bench compares with);
the torch engine always runs one at a time.

Serves what the project should serve (`serving_target`: production, and its canary on a share of
traffic) in the foreground over an OpenAI-compatible HTTP API (bearer keys of scope `serve`);
every completion is recorded as a trajectory. Ctrl-C flushes and stops.

A conversation turn whose prompt + max_tokens would pass --summary-budget tokens (default 3/4 of
--max-model-len; 0: never) is answered in a compacted context: the policy first summarizes the
conversation, and the summary stands in for the earlier turns (inference/conversations.py).

/internal/load and /internal/push listen on their own port (default: the public port + 1), on
loopback unless --internal-host (FLYWHEEL_INTERNAL_HOST) names another address, always behind
FLYWHEEL_INTERNAL_TOKEN, and load only what the database says the project serves: production, or
the running canary.

Serving the project's versions, the process registers as a replica (training/replicas): a row with
the address of its internal listener (--advertise, FLYWHEEL_REPLICA_ADVERTISE_URL; default that
listener's address, this host's name when it binds all interfaces), what it serves and a heartbeat
every FLYWHEEL_REPLICA_HEARTBEAT_S. A promotion pushes it the deltas it lacks (/internal/push);
on (re)start it loads what the database says, so a replica that was down catches up.

With --background-rollouts K (FLYWHEEL_BACKGROUND_ROLLOUTS) the replica also samples training
runs' group rollouts in the room its users leave (inference/background.py: live requests first, at
most K background sequences at once, on the weights the run pushes); its row says so and shows the
share of its time they took.

It lives in `training` because it knows both sides: the versions (which weights, verified from
the checkpoint store) and the serving process (`inference.serving`), which is handed folders and
never reads versions itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError, close_old_connections

from core.db import keep_connections
from core.errors import NotFound
from core.heap import freeze_startup_heap
from feedback.models import Project
from feedback.services import feedback_ingest, quarantine_record
from inference import apis, background, metrics, replica, serving
from inference.background import BackgroundRollouts
from inference.engines import AdapterView, Engine, EngineFactory, is_adapter_folder, new_event_loop
from inference.engines.openmp import release_team
from inference.listeners import INTERNAL_URLS, PUBLIC_URLS, Listeners
from inference.serving import PolicyServer, Recorder, ServingError
from inference.tokens import replica_token
from kernels.delta import CheckpointCorrupt
from training.models import PolicyVersion
from training.replicas.adapters import AdapterHosts, adapter_folder_or_merged
from training.replicas.agent import ReplicaAgent, servable_canary_share, servable_version
from training.replicas.services import BackgroundBeat
from training.versions.selectors import policy_get, serving_target
from training.versions.services import policy_folder

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve a policy over /v1/chat/completions and /v1/completions, recording trajectories."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True, action="append",
                            help="the project to serve; repeat it to serve several projects in this process "
                                 "(their adapter versions over a shared base on one engine)")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)
        parser.add_argument("--internal-port", type=int, default=None,
                            help="port of /internal/load and /internal/push (default: --port + 1)")
        parser.add_argument("--internal-host", default=os.environ.get("FLYWHEEL_INTERNAL_HOST", "127.0.0.1"),
                            help="address the internal listener binds (default loopback; 0.0.0.0 so that "
                                 "promotions from other machines reach it: FLYWHEEL_INTERNAL_TOKEN required)")
        parser.add_argument("--advertise", default=os.environ.get("FLYWHEEL_REPLICA_ADVERTISE_URL", ""),
                            help="URL of the internal listener as other machines reach it (registered)")
        parser.add_argument("--engine", choices=["vllm", "torch"], default=os.environ.get("FLYWHEEL_ENGINE", "vllm"))
        parser.add_argument("--model-dir", default=None, help="serve this HF folder instead of the production version")
        parser.add_argument("--policy-version", type=int, default=None, help="serve this version, not production")
        parser.add_argument("--max-model-len", type=int, default=512)
        parser.add_argument("--no-record", action="store_true", help="do not store completions as trajectories")
        parser.add_argument("--summary-budget", type=int, default=None,
                            help="tokens (prompt + max_tokens) past which a conversation is summarized before the "
                                 "turn is answered (default: 3/4 of --max-model-len; 0: never)")
        parser.add_argument("--background-rollouts", type=int,
                            default=settings.FLYWHEEL_BACKGROUND_ROLLOUTS, metavar="K",
                            help="take training runs' group rollouts in the room users leave, at most K sequences "
                                 "at once (inference/background.py; default FLYWHEEL_BACKGROUND_ROLLOUTS or 0: off)")
        parser.add_argument("--serial", action="store_true",
                            help="vllm: one request at a time on the in-process engine (no batching across requests)")

    def handle(self, *args, **opts):
        opts["summary_budget"] = summary_budget(opts["summary_budget"], opts["max_model_len"])
        projects = list(dict.fromkeys(opts["project"]))
        if len(projects) > 1 and (opts["model_dir"] is not None or opts["policy_version"] is not None):
            raise CommandError("--model-dir and --policy-version serve one project: name one --project")
        internal_host, internal_port = opts["internal_host"], opts["internal_port"] or opts["port"] + 1
        if internal_host not in LOOPBACK and not (settings.FLYWHEEL_INTERNAL_TOKEN or settings.FLYWHEEL_REPLICA_TOKEN):
            raise CommandError(f"--internal-host {internal_host} exposes /internal/* beyond this machine: set "
                               "FLYWHEEL_INTERNAL_TOKEN (the web app sends the same) or keep it on 127.0.0.1")
        if type(opts["background_rollouts"]) is not int or opts["background_rollouts"] < 0:
            raise CommandError("--background-rollouts must be 0 (off) or the most background sequences at once, "
                               f"e.g. 16; got {opts['background_rollouts']!r}")
        hosts, servers = self._servers(projects, opts)
        server = servers[projects[0]]
        serving.SERVER, serving.SERVERS = server, servers
        worker = background_start(server, opts["background_rollouts"], opts["max_model_len"])
        agents: dict[str, ReplicaAgent] = {}
        if opts["model_dir"] is None and opts["policy_version"] is None:
            address = opts["advertise"] or advertised_address(internal_host, internal_port)
            agents = {slug: _agent(s, opts | {"project": slug}, address, worker if s is server else None)
                      for slug, s in servers.items()}
            apis.REPLICA_TOKEN = settings.FLYWHEEL_REPLICA_TOKEN or (
                replica_token(settings.FLYWHEEL_INTERNAL_TOKEN, address) if settings.FLYWHEEL_INTERNAL_TOKEN else "")
            replica.RECEIVER = partial(_receive, agents)
        names = ", ".join(s.model_name(s.engine.version) for s in servers.values())
        self.stdout.write(f"serving {names} ({opts['engine']}) on "
                          f"http://{opts['host']}:{opts['port']}/v1 (internal: {internal_host}:{internal_port}"
                          f"{f', registered as {address}' if agents else ''})", ending="\n")
        self.stdout.flush()
        # uvicorn re-raises SIGTERM after its graceful shutdown; with the default action the process
        # would die before the recorder flushes. Raising SystemExit runs the `finally` below.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        listeners = Listeners(opts["host"], opts["port"], internal_host, internal_port)
        release_team()  # startup's torch work is done: this thread's OpenMP team would idle beside the engines'
        try:
            _serve(listeners, server.engine.home_loop())
        finally:
            replica.RECEIVER = None
            for agent in agents.values():
                agent.stop()
            if worker is not None:
                background.WORKER = None
                worker.close()
            for each in servers.values():
                each.close()
            hosts.close()
            serving.SERVER, serving.SERVERS = None, {}

    def _servers(self, projects: list[str], opts: dict[str, Any]) -> tuple[AdapterHosts, dict[str, PolicyServer]]:
        """One server per project, the projects' adapter versions on shared base engines."""
        hosts = AdapterHosts(EngineFactory(engine_kind(opts["engine"], opts["serial"]),
                                           {"max_model_len": opts["max_model_len"]}))
        try:
            return hosts, {slug: self._server(slug, opts, hosts) for slug in projects}
        except BaseException:
            hosts.close()
            raise

    def _server(self, slug: str, opts: dict[str, Any], hosts: AdapterHosts) -> PolicyServer:
        project = Project.objects.filter(slug=slug).first()
        if project is None:
            raise CommandError(f"no project {slug!r}: create it with manage.py create_project")
        place = Placement(hosts)
        resolve = _resolver(project, place.folder_of)
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
            server = PolicyServer(project.slug, place.engine(folder, number), recorder,
                                  max_model_len=opts["max_model_len"], engines=hosts.factory,
                                  resolve=_servable(project, resolve), summary_budget=opts["summary_budget"],
                                  host=place.host)
            place.server = server
            server.canary_share_of = partial(servable_canary_share, project)
            if opts["model_dir"] is None and opts["policy_version"] is None and target.canary is not None:
                server.load({"canary": target.canary, "share": target.canary_share})
        except ServingError as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from None
        if recorder is not None:
            recorder.start()
        return server


class Placement:
    """Where a project's versions go: adapters over a base on the process's shared host engine
    for that base (made when the first adapter version needs it: no restart), full weights on
    their own engine."""

    def __init__(self, hosts: AdapterHosts) -> None:
        self.hosts = hosts
        self.host: Engine | None = None
        self.key: str | None = None
        self.server: PolicyServer | None = None

    def folder_of(self, version: PolicyVersion) -> Path:
        if self.host is None:
            found = self.hosts.host_for(version)
            if found is not None:
                self.host, self.key = found
                if self.server is not None:
                    self.server.host = self.host
        return adapter_folder_or_merged(version, self.key)

    def engine(self, folder: Path, number: int) -> Engine:
        if self.host is not None and is_adapter_folder(folder):
            return AdapterView(self.host, folder, number)
        return self.hosts.factory(folder, number)


def summary_budget(value: int | None, max_model_len: int) -> int:
    """--summary-budget, checked before any engine starts (default: 3/4 of --max-model-len)."""
    if type(max_model_len) is not int or max_model_len < 2:
        raise CommandError(f"--max-model-len must be an integer of at least 2 tokens, got {max_model_len!r}")
    try:
        return serving.summary_budget_of(serving.default_summary_budget(max_model_len) if value is None else value,
                                         max_model_len)
    except ServingError as exc:
        raise CommandError(f"--summary-budget: {exc.message}. {exc.fix}") from None


def engine_kind(engine: str, serial: bool) -> str:
    """The engine the serving process runs: vLLM batches concurrent requests unless --serial."""
    return "vllm-async" if engine == "vllm" and not serial else engine


def _resolver(project: Project, folder_of: Callable[[PolicyVersion], Path] = policy_folder):
    def resolve(number: int, role: str) -> Path:
        close_old_connections()
        version = policy_get(project, number)
        if version is None:
            raise ServingError(404, f"no policy version {number} in project {project.slug!r}", "Check the number.")
        try:
            return folder_of(version)
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
        servable_version(project, number, role)
        return resolve(number, role)

    return servable


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def advertised_address(host: str, port: int) -> str:
    """The internal listener's URL as the web app reaches it: loopback stays loopback; an
    all-interfaces bind is reached by this host's name (a container's name on a compose network)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def background_start(server: PolicyServer, slots: int, max_model_len: int) -> BackgroundRollouts | None:
    """With K > 0: the process's background rollouts (a second engine, built from the served
    folder's config and tokenizer when a run first pushes its weights), running."""
    if slots <= 0:
        return None
    worker = BackgroundRollouts(server.engine.model_dir, slots, max_model_len=max_model_len)
    worker.start()
    background.WORKER = worker
    return worker


def _background_beat(worker: BackgroundRollouts) -> BackgroundBeat:
    return BackgroundBeat(worker.slots, worker.window_share(), worker.rollouts)


def _agent(server: PolicyServer, opts: dict[str, Any], address: str,
           worker: BackgroundRollouts | None = None) -> ReplicaAgent:
    """Registers the process as a replica holding what it loaded at start (probed: a version
    that fails its probe is not served), heartbeat running."""
    project = Project.objects.get(slug=opts["project"])
    work_dir = Path(settings.VAR_DIR) / "replicas" / f"{socket.gethostname()}-{opts['port']}-{project.slug}"
    agent = ReplicaAgent(project, server, address, server.resolve, work_dir, engine=opts["engine"])
    if worker is not None:
        agent.background = partial(_background_beat, worker)
    for role, engine in (("production", server.engine), ("canary", server.canary)):
        version = policy_get(project, engine.version) if engine is not None else None
        if engine is None or version is None:
            continue
        folder = server.folders["production"] if role == "production" else Path(engine.model_dir)
        agent.adopt(version, folder)
        try:
            agent.verify(engine, folder, version.number, role)
        except ServingError as exc:
            raise CommandError(f"{exc.message}. Refusing to serve it.") from None
    server.resolve = agent.resolve
    server.verify = agent.verify
    agent.start()
    return agent


def _receive(agents: dict[str, ReplicaAgent], body: bytes, project: str | None = None) -> dict[str, Any]:
    """/internal/push: the push goes to its project's agent (?project=SLUG; default the only one)."""
    if project is None and len(agents) == 1:
        return next(iter(agents.values())).receive(body)
    agent = agents.get(project or "")
    if agent is None:
        raise ServingError(404, f"this serving process serves no project {str(project)[:80]!r}",
                           f"Push with ?project= one of {sorted(agents)}.")
    return agent.receive(body)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def _serve(listeners: Listeners, loop: asyncio.AbstractEventLoop | None) -> None:
    """Runs the listeners until SIGINT or SIGTERM. With an engine that has a loop of its own
    (vllm-async), on that loop: a request's handler then awaits the engine in place, where a loop
    of the listeners' own handed every request to the engine's thread and back (two hops and the
    GIL passed between threads, per request). The main thread waits and takes the signals.
    The heap loaded so far (engines up, versions loaded) is frozen first (core/heap.py)."""
    freeze_startup_heap((PUBLIC_URLS, INTERNAL_URLS))
    if loop is None:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(listeners.serve())
        return
    stopped: list[int] = []

    def stop(signum, frame) -> None:
        stopped.append(signum)
        listeners.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run_coroutine_threadsafe(listeners.serve(), loop).result()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped:
        raise SystemExit(0)


def recorder_for(project: Project) -> Recorder:
    """The serving process's recorder: writes through `feedback_ingest`; a completion that is
    rejected, or whose write raises for any reason but the database being away, is quarantined."""

    def quarantine(event: dict[str, Any], error: str) -> None:
        ident = event.get("id") if isinstance(event, dict) else None
        quarantine_record(project.pk, "serving", f"trajectory {str(ident)[:200]}", error,
                          detail={"policy_version": event.get("policy_version") if isinstance(event, dict) else None})

    def write(events: list[dict[str, Any]]) -> None:
        keep_connections()  # not a new connection per batch
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
