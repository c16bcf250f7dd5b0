"""The replica's side, inside `manage.py serve_policy`: registration, heartbeats, pushes.

A `ReplicaAgent` holds the weights its server serves (state dict, side files, a folder the
engines load) by manifest hash, so a push needs only the deltas from one of them. `receive(body)`
(POST /internal/push on the internal listener) checks that the version is what the database says
the project serves in that role, that the pushed manifest is the one the registry names, decodes
the blobs onto the held base (every tensor hash checked), compares the result with the
manifest's checkpoint hash and the side files with theirs, and only then swaps
(`PolicyServer.load`). A refused push leaves the server serving what it served.

A thread beats every FLYWHEEL_REPLICA_HEARTBEAT_S (what it serves, in its row) and catches up on
its own when it has served something other than the database's target for FLYWHEEL_REPLICA_STALE_S
(a push it missed: the sender died after the commit, or the push was refused), loading from the
checkpoint store. A push normally arrives well within that time and makes the catch-up moot.

    .venv/bin/python -m pytest tests/training/replicas/test_replicas.py -q
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from django.conf import settings
from django.db import close_old_connections, connection

from feedback.models import Project
from inference import metrics
from inference.engines import Engine, read_state_dict
from inference.serving import PolicyServer, ServingError
from kernels.delta import CheckpointCorrupt, checkpoint_hash
from training.models import PolicyVersion
from training.replicas import push
from training.replicas.probe import probe_verify
from training.replicas.services import (
    BackgroundBeat,
    replica_heartbeat,
    replica_probe_record,
    replica_register,
    replica_stop,
)
from training.versions.selectors import policy_get, serving_target

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
# (version number, role) -> an HF folder of its weights, verified (the checkpoint store's path).
StoreResolver = Callable[[int, str], Path]


def servable_version(project: Project, number: int, role: str) -> PolicyVersion:
    """The version, if the database says the project serves it in `role` (production, or the
    running canary); ServingError 409 otherwise, whatever the caller asked."""
    close_old_connections()
    target = serving_target(project.pk)
    wanted = target.production if role in ("production", "start") else target.canary
    version = policy_get(project, number)
    if role != "start" and number != wanted:
        state = version.state if version is not None else "unknown"
        raise ServingError(409, f"v{number} is {state}, not the project's {role} (that is v{wanted})",
                           "Promote it or start its canary first (dashboard or the versions API); the "
                           "deploy then loads it.")
    if version is None:
        raise ServingError(404, f"no policy version {number} in project {project.slug!r}", "Check the number.")
    return version


def servable_canary_share(project: Project, number: int, share: float) -> float:
    """The share the database gives canary v`number` (its running CanaryRun); a load or push that
    asks for another share is refused (409), whoever holds the internal token."""
    close_old_connections()
    target = serving_target(project.pk)
    if target.canary != number:
        raise ServingError(409, f"v{number} is not the project's running canary (that is v{target.canary})",
                           "Start its canary first (dashboard or the versions API); the deploy then loads it.")
    if abs(float(share) - target.canary_share) > 1e-9:
        raise ServingError(409, f"canary v{number} runs at share {target.canary_share} in the database, "
                                f"not {share}", "Send the share its canary run was started with; to change it, "
                                                "decide the canary and start another.")
    return target.canary_share


@dataclass
class Held:
    number: int
    checkpoint: str  # checkpoint hash (kernels.delta) of `state`
    state: dict[str, torch.Tensor]
    files: dict[str, bytes]  # side files by name (config, tokenizer)
    folder: Path
    owned: bool  # the folder is this agent's to delete


class ReplicaAgent:
    def __init__(self, project: Project, server: PolicyServer, address: str, from_store: StoreResolver,
                 work_dir: Path, engine: str = "") -> None:
        self.project, self.server, self.address, self.engine = project, server, address, engine
        self._from_store = from_store
        self.work_dir = work_dir
        self.held: dict[str, Held] = {}  # manifest hash -> weights
        self.replica_id: int | None = None
        self._lock = threading.RLock()  # one push, load or catch-up at a time
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._behind_since: float | None = None
        # The process's background rollouts, reported with each beat (serve_policy sets it when on).
        self.background: Callable[[], BackgroundBeat] = BackgroundBeat
        self.probe: dict[str, Any] = {}  # the last probe's report (training/replicas/probe.py)
        # A push's canary share is the database's (the push carries it for the replica's log).
        server.canary_share_of = partial(servable_canary_share, project)

    # --- what is served -------------------------------------------------------------------
    def served(self) -> dict[str, Any]:
        canary = self.server.canary
        held = self.server.host.adapters_held() if self.server.host is not None else []
        mine = self.server.adapters()
        return {"version": self.server.engine.version, "canary": canary.version if canary else None,
                "canary_share": self.server.canary_share if canary else 0.0, "adapters": mine,
                "adapters_other": max(len(held) - len(mine), 0), "probe": self.probe}

    def verify(self, engine: Engine, folder: Path, number: int, role: str) -> None:
        """The server's check of staged weights (PolicyServer.verify): the probe against the
        trainer's log-probs and the loaded hash against the manifest; refused: ServingError 409,
        recorded on this replica's row and counted, and the server keeps what it served."""
        version = policy_get(self.project, number)
        if version is None:
            raise ServingError(404, f"no policy version {number} in project {self.project.slug!r}", "Check the number.")
        report = probe_verify(version, engine, folder, role, self.engine)
        self.probe = report.as_dict()
        metrics.SERVING_PROBE.labels(self.project.slug, "ok" if report.ok else "refused").inc()
        metrics.SERVING_PROBE_DIFF.labels(self.project.slug, role).set(
            report.max_diff if report.max_diff is not None and report.max_diff != float("inf") else -1)
        if self.replica_id is not None:
            close_old_connections()
            replica_probe_record(self.replica_id, self.probe)
        if not report.ok:
            log.error("replica %s refused v%d (%s): %s", self.address, number, role, report.problem)
            raise ServingError(409, f"v{number} failed the probe after loading: {report.problem}",
                               f"Nothing was swapped: this replica still serves v{self.server.engine.version}"
                               f"{' as production' if role == 'production' else ''}. Check the version's "
                               "checkpoint (manage.py audit verify) and the replica's engine, then push again.")

    def resolve(self, number: int, role: str) -> Path:
        """The server's resolver: only what the database says; from the held weights when this
        replica holds them, else from the checkpoint store (and held from then on)."""
        version = servable_version(self.project, number, role)
        with self._lock:  # /internal/load reaches here without a push's lock
            held = self.held.get(version.manifest_hash) if version.manifest_hash else None
            if held is not None:
                return held.folder
            folder = self._from_store(number, role)
            self.adopt(version, folder)
            return folder

    def adopt(self, version: PolicyVersion, folder: Path) -> None:
        """Hold weights the server loaded from `folder` (so pushes can start from them)."""
        if not version.manifest_hash or version.manifest_hash in self.held:
            return
        state = read_state_dict(folder)
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors"}
        self.held[version.manifest_hash] = Held(version.number, checkpoint_hash(state), state, files, folder, False)

    # --- pushes ---------------------------------------------------------------------------
    def receive(self, body: bytes) -> dict[str, Any]:
        """POST /internal/push: verify, swap, acknowledge with what is served now."""
        try:
            header, blobs, files = push.push_decode(body)
        except push.PushMalformed as exc:
            raise ServingError(400, f"the push is malformed: {exc}",
                               "Send what training.replicas.push.push_encode builds.") from None
        role, number = header.get("role"), header.get("version")
        if role not in ("production", "canary") or (number is not None and type(number) is not int) or (
                number is None and role == "production"):
            raise ServingError(400, "a push names a 'role' (production | canary) and an integer 'version'",
                               "Send {\"role\": \"production\", \"version\": 3, ...}; only a canary may be null.")
        with self._lock:
            if number is None:
                self.server.load({"canary": None})
            else:
                if "manifest" in header:
                    self._take(number, role, header, blobs, files)
                self.server.load({"version": number} if role == "production"
                                 else {"canary": number, "share": header.get("share")})
            self._prune()
            return {**self.served(), "received_bytes": len(body)}

    def _take(self, number: int, role: str, header: dict[str, Any], blobs: list[bytes],
              files: dict[str, bytes]) -> None:
        version = servable_version(self.project, number, role)
        if version.manifest_hash in self.held:
            return
        base = header.get("base")
        held = self.held.get(base) if isinstance(base, str) else None
        if base is not None and held is None:
            raise ServingError(409, f"this replica does not hold the push's base {str(base)[:12]}",
                               "Push again from what its registry row says it serves, or restart it (it then "
                               "loads from the checkpoint store).")
        try:
            manifest = push.manifest_check(str(header["manifest"]), version.manifest_hash)
            state, checkpoint = push.push_apply(held.state if held else None, held.checkpoint if held else None, blobs)
            if checkpoint != manifest["checkpoint_hash"]:
                raise CheckpointCorrupt("the pushed blobs rebuild another checkpoint than the manifest names")
            side = push.files_check(manifest, files, held.files if held else {})
        except CheckpointCorrupt as exc:
            served = self.served()
            raise ServingError(409, f"the push of v{number} is refused: {exc}",
                               f"Nothing was swapped: this replica still serves v{served['version']}. Push again "
                               "(a new promotion or canary does), or restart the replica to load from the store.") from None
        folder = self._write(version.manifest_hash, state, side)
        self.held[version.manifest_hash] = Held(number, checkpoint, state, side, folder, True)

    def _write(self, manifest_hash: str, state: dict[str, torch.Tensor], files: dict[str, bytes]) -> Path:
        from safetensors.torch import save_file

        out = self.work_dir / manifest_hash
        if (out / "config.json").exists():
            return out
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.work_dir, prefix=".push-"))
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, tmp / WEIGHTS, metadata={"format": "pt"})
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)  # the engines never see a half-written folder
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out

    def _prune(self) -> None:
        """Keep only the weights of what is served now."""
        served = self.served()
        keep = {served["version"], served["canary"]}
        for key, held in list(self.held.items()):
            if held.number not in keep:
                del self.held[key]
                if held.owned:
                    shutil.rmtree(held.folder, ignore_errors=True)

    # --- registration and heartbeat -------------------------------------------------------
    def register(self) -> None:
        close_old_connections()
        row = replica_register(self.project, self.address, hostname=socket.gethostname(), pid=os.getpid(),
                               engine=self.engine, background=self.background(), **self.served())
        self.replica_id = row.id

    def start(self) -> None:
        self.register()
        self._thread = threading.Thread(target=self._loop, name="replica-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        close_old_connections()
        # Under the push lock: a beat that read what is served before a push swapped, and wrote it
        # after the broadcaster recorded the push's ack, would put the old version back in the row
        # (until the next beat) for the registry, the broadcaster's next plan and the canary count.
        with self._lock:
            if self.replica_id is None or not replica_heartbeat(self.replica_id, background=self.background(),
                                                                **self.served()):
                self.register()
        self.catch_up()

    def catch_up(self, patience_s: float | None = None) -> bool:
        """Loads the database's target (from held weights or the store) once this replica has
        served something else for `patience_s` (default FLYWHEEL_REPLICA_STALE_S); True if it did."""
        patience_s = settings.FLYWHEEL_REPLICA_STALE_S if patience_s is None else patience_s
        target = serving_target(self.project.pk)
        if target.production is None or self._matches(target):
            self._behind_since = None
            return False
        now = time.monotonic()
        self._behind_since = self._behind_since or now
        if now - self._behind_since < patience_s:
            return False
        with self._lock:
            target = serving_target(self.project.pk)
            if self._matches(target):
                return False
            body: dict[str, Any] = {"version": target.production, "canary": target.canary}
            if target.canary is not None:
                body["share"] = target.canary_share
            log.warning("replica %s serves %s, the project %s: catching up from the store", self.address,
                        self.served(), target)
            self.server.load(body)
            self._prune()
        self._behind_since = None
        return True

    def _matches(self, target: Any) -> bool:
        served = self.served()
        return (served["version"], served["canary"]) == (target.production, target.canary) and (
            target.canary is None or abs(served["canary_share"] - target.canary_share) < 1e-9)

    def _loop(self) -> None:
        try:
            while not self._stopping.wait(settings.FLYWHEEL_REPLICA_HEARTBEAT_S):
                try:
                    self.beat()
                except Exception:  # noqa: BLE001 - the database away, a load that failed: beat again later
                    log.warning("replica heartbeat of %s failed", self.address, exc_info=True)
        finally:
            connection.close()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.replica_id is not None:
            close_old_connections()
            replica_stop(self.replica_id)
