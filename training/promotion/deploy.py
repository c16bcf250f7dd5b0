"""Telling the serving process what to serve: a small transport class + a factory on a setting.

`deploy_hook(version)` is called (after commit) whenever a promotion, canary or rollback changes
what a project should serve. The desired state is always in the database (the PolicyVersion
states; `serving_target` reads it), so a transport only has to *announce* it:

- "http" (the default when FLYWHEEL_INFERENCE_URL is set): push every live registered replica of
  the project (training/replicas: `serve_policy` registers each, with the address of its internal
  listener) only the delta chain it lacks, on /internal/push; each verifies against the manifest,
  swaps and acks, and its row records what it serves. A project with no registered replica (a
  serving process of an older release) gets the legacy POST of /internal/load at
  FLYWHEEL_INFERENCE_INTERNAL_URL. Either way the server checks the numbers against the database.
- "record": push a `deploy` notice to the dashboard only; `serve_policy` picks the production
  version up when it (re)starts.
Transports register with `@register_transport(name)`; settings.FLYWHEEL_DEPLOY_TRANSPORT chooses.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import httpx
from django.conf import settings

from core.notify import project_event
from training.models import PolicyVersion
from training.replicas.selectors import replicas_registered
from training.replicas.services import replicas_broadcast
from training.versions.selectors import DeployTarget, serving_target

log = logging.getLogger(__name__)



class DeployTransport(ABC):
    name: str = ""

    @abstractmethod
    def send(self, target: DeployTarget) -> None:
        """Announce `target` to the serving process; raise only if it must be retried."""


TRANSPORTS: dict[str, type[DeployTransport]] = {}


def register_transport(name: str) -> Callable[[type[DeployTransport]], type[DeployTransport]]:
    def add(cls: type[DeployTransport]) -> type[DeployTransport]:
        cls.name = name
        TRANSPORTS[name] = cls
        return cls

    return add


@register_transport("record")
class RecordTransport(DeployTransport):
    """The state is already recorded in PolicyVersion rows: push a notice and log it."""

    def send(self, target: DeployTarget) -> None:
        log.info("deploy target of project %s: %s", target.project_id, target)
        project_event(target.project_id, {"type": "deploy", **target.as_dict()})


def make_deploy_transport(kind: str | None = None) -> DeployTransport:
    kind = kind or getattr(settings, "FLYWHEEL_DEPLOY_TRANSPORT", "") or "record"
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown deploy transport {kind!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[kind]()


def deploy_hook(version: PolicyVersion) -> DeployTarget:
    """Tell the serving process the new desired state of `version`'s project."""
    target = serving_target(version.project_id)
    try:
        make_deploy_transport().send(target)
    except Exception as exc:  # noqa: BLE001 - the decision is committed; the server catches up on restart
        # The serving process reads serving_target() when it starts, so nothing is lost; the
        # dashboard shows the failure so a person can act.
        if isinstance(exc, httpx.TransportError):  # the serving process is not up (yet): expected, no trace
            log.warning("deploy of project %s not delivered (%s); the serving process reads the target when it "
                        "starts", version.project_id, exc)
        else:
            log.exception("deploy of project %s failed", version.project_id)
        project_event(version.project_id, {"type": "deploy_failed", "error": f"{type(exc).__name__}: {exc}",
                                           **target.as_dict()})
    return target


@register_transport("http")
class HttpTransport(DeployTransport):
    """Pushes the target to every live replica (deltas only), or POSTs it to the one serving
    process's internal endpoint (inference/apis.py) when none registered."""

    def send(self, target: DeployTarget) -> None:
        if replicas_registered(target.project_id):
            self._broadcast(target)
            return
        url = settings.FLYWHEEL_INFERENCE_INTERNAL_URL.rstrip("/") + "/internal/load"
        body: dict[str, Any] = {"canary": target.canary}
        if target.production is not None:
            body["version"] = target.production
        if target.canary is not None:
            body["share"] = target.canary_share
        headers = {"Authorization": f"Bearer {settings.FLYWHEEL_INTERNAL_TOKEN}"}
        response = httpx.post(url, json=body, headers=headers, timeout=120)
        response.raise_for_status()
        project_event(target.project_id, {"type": "deploy", "served": response.json(), **target.as_dict()})

    def _broadcast(self, target: DeployTarget) -> None:
        outcomes = replicas_broadcast(target, settings.FLYWHEEL_INTERNAL_TOKEN)
        project_event(target.project_id, {"type": "deploy", "replicas": [o.as_dict() for o in outcomes],
                                          **target.as_dict()})
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise ReplicaPushFailed("; ".join(f"{o.address}: {o.error}" for o in failed))


class ReplicaPushFailed(RuntimeError):
    """Some replicas did not take the push (their rows say why); they catch up from the store
    within two heartbeats, or when they restart."""
