"""Writes of serving replicas: registration, heartbeats, and the broadcast a promotion makes.

`replicas_broadcast(target)` pushes every live replica of the project (in parallel) only what
it lacks to serve `target`: for each role whose version differs, the delta chain from a
checkpoint it holds (training/replicas/push.py), and records each acknowledgement (what the
replica now serves, when, how many bytes) or the failure on the replica's row.

    .venv/bin/python -m pytest tests/training/replicas/test_replicas.py -q
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import httpx
from django.utils import timezone

from feedback.models import Project
from inference.tokens import replica_token
from training.models import PolicyVersion, ReplicaState, ServingReplica
from training.replicas.selectors import replicas_live
from training.versions.selectors import DeployTarget
from training.versions.services import checkpoint_store

log = logging.getLogger(__name__)

PUSH_PATH = "/internal/push"
PUSH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BackgroundBeat:
    """A replica's background rollouts as its heartbeat reports them (inference/background.py):
    its capacity K (0: off), the share of wall time they took since the last beat, the total."""

    slots: int = 0
    share: float = 0.0
    rollouts: int = 0

    def fields(self) -> dict[str, Any]:
        return {"background_slots": self.slots, "background_share": max(0.0, min(1.0, self.share)),
                "background_rollouts": self.rollouts}


def replica_register(project: Project, address: str, *, version: int | None, canary: int | None = None,
                     canary_share: float = 0.0, hostname: str = "", pid: int | None = None,
                     engine: str = "", background: BackgroundBeat = BackgroundBeat(),
                     **held: Any) -> ServingReplica:
    """A serving process (re)registers: one row per project and address, live from now. `held`:
    its adapters and last probe (`_held_fields`)."""
    now = timezone.now()
    replica, _ = ServingReplica.objects.update_or_create(
        project=project, address=address,
        defaults={"hostname": hostname[:255], "pid": pid, "engine": engine, "state": "serving",
                  "version": version, "canary": canary, "canary_share": canary_share,
                  "registered_at": now, "heartbeat_at": now, "error": "", **background.fields(),
                  **_held_fields(held)})
    return replica


def replica_heartbeat(replica_id: int, *, version: int | None, canary: int | None, canary_share: float,
                      background: BackgroundBeat = BackgroundBeat(), **held: Any) -> bool:
    """The replica is alive and serves these versions; False if its row is gone (re-register)."""
    return ServingReplica.objects.filter(id=replica_id).update(
        heartbeat_at=timezone.now(), state=ReplicaState.SERVING, version=version, canary=canary,
        canary_share=canary_share, **background.fields(), **_held_fields(held)) == 1


def _held_fields(held: dict[str, Any]) -> dict[str, Any]:
    """The adapters and probe a replica reports (served()), as its row's fields."""
    out: dict[str, Any] = {}
    if isinstance(held.get("adapters"), list):
        out["adapters"] = held["adapters"][:64]
    if type(held.get("adapters_other")) is int:
        out["adapters_other"] = max(held["adapters_other"], 0)
    if isinstance(held.get("probe"), dict):
        out["probe"] = held["probe"]
    return out


def replica_probe_record(replica_id: int, probe: dict[str, Any]) -> None:
    """The replica's last probe after a swap (a refused one stays until the next probe)."""
    ServingReplica.objects.filter(id=replica_id).update(probe=probe)


def replica_stop(replica_id: int) -> None:
    """A clean shutdown: the replica counts as down at once (no wait for its heartbeat to age)."""
    ServingReplica.objects.filter(id=replica_id).update(state=ReplicaState.STOPPED)


@dataclass
class PushOutcome:
    replica_id: int
    address: str
    ok: bool
    sent_bytes: int = 0
    served: dict[str, Any] | None = None
    error: str = ""
    acked_at: datetime | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["acked_at"] = self.acked_at.isoformat() if self.acked_at else None
        return out


def replicas_broadcast(target: DeployTarget, token: str, timeout: float = PUSH_TIMEOUT_S) -> list[PushOutcome]:
    """Pushes `target` to every live replica of its project; returns one outcome per replica."""
    replicas = list(replicas_live(target.project_id))
    if not replicas:
        return []
    planner = PushPlanner(target, replicas)
    plans = [(r, planner.bodies(r)) for r in replicas]  # database and store reads stay on this thread
    slug = Project.objects.values_list("slug", flat=True).get(pk=target.project_id)
    with ThreadPoolExecutor(max_workers=min(len(plans), 32)) as pool:
        outcomes = list(pool.map(lambda p: _send(p[0], p[1], token, timeout, slug), plans))
    for outcome in outcomes:
        _record(outcome)
    return outcomes


def _record(outcome: PushOutcome) -> None:
    rows = ServingReplica.objects.filter(id=outcome.replica_id)
    if not outcome.ok:
        rows.update(error=outcome.error[:2000])
    elif outcome.served is not None:
        rows.update(version=outcome.served.get("version"), canary=outcome.served.get("canary"),
                    canary_share=outcome.served.get("canary_share") or 0.0, acked_at=outcome.acked_at,
                    pushed_bytes=outcome.sent_bytes, error="", **_held_fields(outcome.served))


def _send(replica: ServingReplica, bodies: list[bytes], token: str, timeout: float, slug: str = "") -> PushOutcome:
    outcome = PushOutcome(replica.id, replica.address, ok=True)
    # Each replica gets its own token (inference/apis.py `replica_token`), never the shared one.
    headers = {"Authorization": f"Bearer {replica_token(token, replica.address)}",
               "Content-Type": "application/octet-stream"}
    try:
        with httpx.Client(timeout=timeout, headers=headers) as http:
            for body in bodies:
                # ?project=: a serving process may serve several projects (serve_policy --project A --project B).
                response = http.post(replica.address.rstrip("/") + PUSH_PATH, content=body,
                                     params={"project": slug} if slug else None)
                outcome.sent_bytes += len(body)
                if response.status_code != 200:
                    outcome.ok, outcome.error = False, f"{response.status_code}: {_reason(response)}"
                    return outcome
                outcome.served, outcome.acked_at = response.json(), timezone.now()
    except httpx.HTTPError as exc:
        outcome.ok, outcome.error = False, f"{type(exc).__name__}: {exc}"
    return outcome


def _reason(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{error['message']}. {error.get('fix', '')}".strip()
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


class PushPlanner:
    """Builds each replica's push bodies; a body is built once per (role, version, base) and
    shared by every replica that needs it (the usual case: all hold the same production)."""

    def __init__(self, target: DeployTarget, replicas: list[ServingReplica]) -> None:
        # Imported here: the push module imports torch, which only a broadcast needs.
        from training.replicas import push

        self.push, self.target, self.store = push, target, checkpoint_store()
        numbers = {n for r in replicas for n in (r.version, r.canary)} | {target.production, target.canary}
        rows = list(PolicyVersion.objects.filter(project_id=target.project_id,
                                                 number__in=[n for n in numbers if n is not None])
                    .values_list("number", "manifest_hash", "adapter_base_id"))
        self.hashes: dict[int, str] = {number: manifest for number, manifest, _ in rows}
        # LoRA versions: their stored blob is the adapter, while a replica serves (and holds) the
        # merged weights, so no delta is pushed to or from them; the replica merges from the store.
        self.adapters = {number for number, _, base in rows if base is not None}
        self._cache: dict[tuple[Any, ...], bytes] = {}

    def bodies(self, replica: ServingReplica) -> list[bytes]:
        t, out = self.target, []
        if t.production is not None and replica.version != t.production:
            out.append(self._body("production", t.production, None, [replica.version, replica.canary]))
        if (replica.canary, replica.canary_share if replica.canary else 0.0) != (t.canary, t.canary_share):
            if t.canary is None:
                out.append(self.push.push_encode({"role": "canary", "version": None}, [], {}))
            else:
                held_after = [t.production if t.production is not None else replica.version, replica.canary]
                out.append(self._body("canary", t.canary, t.canary_share, held_after))
        return out

    def _body(self, role: str, number: int, share: float | None, held: list[int | None]) -> bytes:
        target_hash = self.hashes.get(number) or ""
        header: dict[str, Any] = {"role": role, "version": number, "share": share}
        if not target_hash or not self.store.storage.exists(target_hash) or number in self.adapters:
            # Not in this machine's store, or an adapter: the replica loads it from its own store
            # (catch-up path; an adapter's folder there is its base with the adapter merged in).
            return self.push.push_encode(header, [], {})
        bases = list(dict.fromkeys(self.hashes.get(n) for n in held
                                   if n is not None and self.hashes.get(n) and n not in self.adapters))
        best: bytes | None = None
        for base in bases or [None]:
            key = (role, number, share, base)
            if key not in self._cache:
                self._cache[key] = self._encode(header, base, target_hash)
            if best is None or len(self._cache[key]) < len(best):
                best = self._cache[key]
        assert best is not None
        return best

    def _encode(self, header: dict[str, Any], base: str | None, target_hash: str) -> bytes:
        manifest = self.store.storage.get(target_hash).decode()
        if base == target_hash:
            blobs, files = [], {}
        else:
            blobs = self.push.push_plan(self.store, base, target_hash)
            files = self.push.files_plan(self.store, base, target_hash)
        return self.push.push_encode({**header, "manifest": manifest, "base": base}, blobs, files)
