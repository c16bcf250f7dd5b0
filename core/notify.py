"""The one notifier: pushes a payload to a project's dashboard group over the channel layer.

Failures are logged, never raised: a push happens after a commit and must not turn an
acknowledged write into an error. A push is bounded in time (PUSH_TIMEOUT_S: a Redis that hangs
costs the request that much, not a hang) and tried twice when its connection fails (the pooled
connection of a Redis that restarted is stale once).

Pushes from sync code run on one event loop per process, in a daemon thread of its own, so the
channel layer's Redis connections (pooled per loop) live as long as the process. Ingest's counts
are summed per project and pushed at most every INGEST_PUSH_EVERY_S (`ingest_pushed`). (`async_to_sync`
from a thread with no loop would start a thread, a loop and a Redis connection for every push:
about 1.6 ms of CPU, a tenth of what a batch of 100 events costs the web server.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Literal, NotRequired, TypedDict

from channels.layers import get_channel_layer
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 2.0


class IngestPushed(TypedDict):
    type: Literal["ingest"]
    accepted: int
    duplicate: int
    rejected: int


class RewardsComputed(TypedDict):
    type: Literal["rewards_computed"]
    spec: int
    count: int


class TrainingPushed(TypedDict):
    """training_queued | training_started | training_step | training_succeeded | training_failed."""

    type: Literal["training_queued", "training_started", "training_step", "training_succeeded", "training_failed"]
    run: int
    base: NotRequired[int]
    worker: NotRequired[str]
    step: NotRequired[int]
    progress: NotRequired[float]
    candidate: NotRequired[int]
    error: NotRequired[str]
    # training_step also carries its metrics (loss, kl_ref, ... tokens_per_s) as floats


class PolicyVersionPushed(TypedDict):
    type: Literal["policy_version"]
    action: str
    version: int
    before: str
    after: str
    actor: str


class DeployPushed(TypedDict):
    type: Literal["deploy", "deploy_failed"]
    project_id: int
    production: int | None
    canary: int | None
    canary_share: float
    served: NotRequired[dict[str, Any]]
    error: NotRequired[str]


Payload = IngestPushed | RewardsComputed | TrainingPushed | PolicyVersionPushed | DeployPushed


def project_group(project_id: int) -> str:
    return f"project-{project_id}"


def project_event(project_id: int, payload: Payload) -> None:
    """Pushes `payload` to the project's dashboard group (consumers forward it to the browser).
    From sync code it returns once the push is done or has failed (within 2 x PUSH_TIMEOUT_S);
    called where an event loop runs (async code), it schedules the push and returns at once."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        future = asyncio.run_coroutine_threadsafe(
            channel_layer_call(layer.group_send, project_group(project_id), {"type": "project.event", "payload": payload}),
            _push_loop(),
        )
        if not _in_event_loop():
            future.result(timeout=2 * PUSH_TIMEOUT_S + 1)
    except Exception as exc:  # noqa: BLE001 - a lost push is shown as stale data, never as a failed write
        log.warning("could not push %s to project %s: %s: %s", payload.get("type"), project_id,
                    type(exc).__name__, exc)


INGEST_PUSH_EVERY_S = 0.25


def ingest_pushed(project_id: int, counts: dict[str, int]) -> None:
    """Adds a committed batch's counts to the project's next `ingest` push and returns at once: the
    push loop sends one push a project every INGEST_PUSH_EVERY_S at most, with the counts summed
    (the dashboard adds them up). A request neither waits for Redis nor pays a push of its own: at
    a hundred batches a second that was a hundred group sends, each several Redis commands."""
    with _tally_lock:
        tally = _tallies.get(project_id)
        if tally is None:
            _tallies[project_id] = dict(counts)
            first = True
        else:
            for name, n in counts.items():
                tally[name] = tally.get(name, 0) + n
            first = False
    if first:
        try:
            loop = _push_loop()
            loop.call_soon_threadsafe(loop.call_later, INGEST_PUSH_EVERY_S, _flush_soon, project_id)
        except RuntimeError as exc:  # a loop closed under us (interpreter exit): the push is lost, never the write
            log.warning("could not schedule the ingest push of project %s: %s", project_id, exc)


def _flush_soon(project_id: int) -> None:
    """On the push loop: the project's summed counts, pushed as any payload is."""
    with _tally_lock:
        counts = _tallies.pop(project_id, None)
    if counts:
        project_event(project_id, {"type": "ingest", **counts})


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_tally_lock = threading.Lock()
_tallies: dict[int, dict[str, int]] = {}  # project -> counts not pushed yet


def _push_loop() -> asyncio.AbstractEventLoop:
    """The process's push loop, started on first use."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None or _loop_thread is None or not _loop_thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="flywheel-notify", daemon=True)
            thread.start()
            _loop, _loop_thread = loop, thread
        return _loop


def _forget_loop() -> None:
    # A forked child (a Celery pool process) has neither the parent's thread nor, safely, its locks;
    # the parent's unpushed counts are the parent's to push.
    global _loop_lock, _loop, _loop_thread, _tally_lock, _tallies
    _loop_lock, _loop, _loop_thread = threading.Lock(), None, None
    _tally_lock, _tallies = threading.Lock(), {}


os.register_at_fork(after_in_child=_forget_loop)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def channel_layer_call(method: Any, *args: Any) -> Any:
    """`await method(*args)` on the channel layer within PUSH_TIMEOUT_S, once more after a
    connection error (a pooled connection that a Redis restart left stale is replaced)."""
    try:
        return await asyncio.wait_for(method(*args), PUSH_TIMEOUT_S)
    except RedisConnectionError:
        return await asyncio.wait_for(method(*args), PUSH_TIMEOUT_S)
