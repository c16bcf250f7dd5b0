"""The serving process: OpenAI-compatible completions that remember what they sampled.

    .venv/bin/python manage.py serve_policy --project demo --port 8001 [--engine vllm|torch]

Every served completion becomes a Trajectory (+ Step with token ids, behaviour log-probs, MoE
routing and the policy version) through `feedback_ingest`, written in batches by a recorder
thread off the request path and flushed on shutdown. A product sends feedback against the
`trajectory_id` each choice carries. Weights are swapped between requests by `load_version`
(internal endpoint), and a canary share of requests can go to a second loaded version.

Concurrency: the HTTP views are async and call `acomplete`. With the vllm-async engine (the
default of serve_policy --engine vllm) concurrent requests share the engine's batches and a swap
waits for the requests in flight (each is generated, and recorded, under one version); the torch
engine and the serialised vLLM engine (serve_policy --serial) run one request at a time.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.problems import ApplicationError, status_code_name
from inference import metrics
from inference.engines import (
    AdapterView,
    Completion,
    Engine,
    EngineFactory,
    SamplingParams,
    is_adapter_folder,
)

log = logging.getLogger(__name__)

MAX_N = 16
MAX_TOKENS = 512
# Bounds checked before a prompt reaches the tokenizer: characters per token of a prompt that can
# still fit the context (a byte-level BPE token rarely spans more), messages and stop strings.
PROMPT_CHARS_PER_TOKEN = 16
MAX_MESSAGES = 64
# A conversation's history as the client sends it (all of it, every turn): past a summary the
# server reads only its prompt and the messages since (at most MAX_MESSAGES; inference/conversations.py).
MAX_HISTORY = 1024


class ServingError(ApplicationError):
    """A request the server refuses: the one error family's type (core/problems.py) with the
    HTTP status given where it is raised; the message says what, `fix` how."""

    def __init__(self, status: int, message: str, fix: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, fix, headers=headers)
        self.status_code, self.code = status, status_code_name(status)


@dataclass
class CompletionRequest:
    model: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    n: int
    sampling: SamplingParams
    want_logprobs: bool
    task: str = "chat"
    user: str | None = None  # the OpenAI request's `user`: whose data the trajectory is (stored hashed)
    # Hooks of the tool-call and conversation modules (inference/tools.py, conversations.py):
    # more fields of a recorded step, and where its trajectory goes instead of the recorder.
    step_fields: Callable[[Completion, str], dict[str, Any]] | None = None
    record: Callable[[list[dict[str, Any]]], None] | None = None


@dataclass
class Served:
    completions: list[Completion]
    trajectory_ids: list[str]
    version: int


def _always_transient(exc: Exception) -> bool:
    return True


@dataclass
class Recorder:
    """Writes served completions as trajectories in batches, off the request path.

    A write that fails with a transient error (`transient(exc)`: the database is restarting) is
    retried, then the batch is queued again. Any other failure is a poison pill: the batch is
    written event by event and each event that still fails goes to `quarantine(event, error)`,
    so one bad completion never holds up the others.

    The queue holds at most `max_pending` events: the server refuses new completions while it is
    `full()` (503, so nothing it answered is lost), and an event put past the bound (a batch
    queued again during a long outage) is shed and counted (flywheel_serving_recorder_shed)."""

    write: Callable[[list[dict[str, Any]]], None]
    max_pending: int = 20_000
    batch_size: int = 200
    interval_s: float = 0.25
    quarantine: Callable[[dict[str, Any], str], None] | None = None
    transient: Callable[[Exception], bool] = _always_transient
    _queue: queue.Queue = field(default_factory=queue.Queue)
    _thread: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trajectory-recorder", daemon=True)
        self._thread.start()

    def put(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if self._queue.qsize() >= self.max_pending:
                metrics.RECORDER_SHED.labels("dropped").inc()
                log.error("recorder queue full (%d): served completion %s shed", self.max_pending,
                          event.get("id") if isinstance(event, dict) else None)
                continue
            self._queue.put(event)

    def pending(self) -> int:
        return self._queue.qsize()

    def full(self) -> bool:
        return self._queue.qsize() >= self.max_pending

    def flush(self) -> int:
        batch: list[dict[str, Any]] = []
        while len(batch) < 1000:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if batch:
            self._write(batch)
        return len(batch)

    def close(self) -> None:
        """Stops the thread and writes everything still queued (called on shutdown)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
        while self.flush():
            pass

    def _loop(self) -> None:
        while not self._stopping.is_set():
            time.sleep(self.interval_s)
            while self._queue.qsize() and self.flush() >= self.batch_size:
                pass

    def _write(self, batch: list[dict[str, Any]]) -> None:
        for attempt in range(5):
            try:
                self.write(batch)
                return
            except Exception as exc:  # noqa: BLE001 - sorted below: a restarting database or a poison pill
                if self.quarantine is not None and not self.transient(exc):
                    self._write_each(batch)
                    return
                log.warning("recording %d trajectories failed (attempt %d)", len(batch), attempt + 1, exc_info=True)
                time.sleep(0.5 * 2**attempt)
        self.put(batch)

    def _write_each(self, batch: list[dict[str, Any]]) -> None:
        assert self.quarantine is not None
        for event in batch:
            try:
                self.write([event])
            except Exception as exc:  # noqa: BLE001 - this event is the poison pill, or the database went away
                if self.transient(exc):
                    self.put([event])
                else:
                    self.quarantine(event, f"{type(exc).__name__}: {exc}")


# (version number, role "production" | "canary") -> a verified HF folder of its weights; raises
# ServingError (404 unknown, 409 not what the project should serve in that role, or not on this
# machine). Handed in by whoever knows the versions (the serve_policy command).
WeightsResolver = Callable[[int, str], Path]


def _no_versions(number: int, role: str) -> Path:
    raise ServingError(409, "this serving process was started on a folder, not on the project's versions",
                       "Start it with `manage.py serve_policy --project SLUG` (without --model-dir).")


class PolicyServer:
    """Engines by version, the production/canary routing, and the recorder."""

    def __init__(self, project_slug: str, engine: Engine, recorder: Recorder | None,
                 max_model_len: int = 512, canary_seed: int | None = None,
                 engines: EngineFactory | None = None, resolve: WeightsResolver = _no_versions,
                 summary_budget: int = 0, host: Engine | None = None) -> None:
        self.project_slug = project_slug
        # Conversation turns whose prompt + max_tokens would pass this many tokens are answered in a
        # compacted context (inference/conversations.py); 0: never.
        self.summary_budget = summary_budget_of(summary_budget, max_model_len)
        self.engine = engine
        self.engines = engines
        self.resolve = resolve
        self.canary: Engine | None = None
        self.canary_share = 0.0
        self.recorder = recorder
        self.max_model_len = max_model_len
        self._rng = random.Random(canary_seed)
        self._swap_lock = threading.Lock()
        self.on_close: list[Callable[[], None]] = []  # run before the recorder's last flush
        # (canary number, share asked) -> the share to run it at, or ServingError; set by whoever
        # knows the database (serve_policy, training/replicas/agent.py). None: the share asked.
        self.canary_share_of: Callable[[int, float], float] | None = None
        # Adapter versions: the engine holding their base, shared by this server's views (and by
        # other projects' servers over the same base); None: every version is full weights.
        self.host = host
        # (staged engine, its folder, version, role) -> None, or ServingError: called after new
        # weights are loaded and before they serve (the probe, training/replicas/probe.py).
        self.verify: Callable[[Engine, Path, int, str], None] | None = None
        self.folders: dict[str, Path] = {"production": Path(engine.model_dir)}

    # --- names ------------------------------------------------------------------------------
    def model_name(self, version: int) -> str:
        return f"{self.project_slug}-v{version}"

    def model_names(self) -> list[str]:
        names = [self.project_slug, self.model_name(self.engine.version)]
        if self.canary is not None:
            names.append(self.model_name(self.canary.version))
        return names

    def pick_engine(self, model: str) -> Engine:
        if model == self.model_name(self.engine.version):
            return self.engine
        if self.canary is not None and model == self.model_name(self.canary.version):
            return self.canary
        if model == self.project_slug:
            if self.canary is not None and self._rng.random() < self.canary_share:
                return self.canary
            return self.engine
        raise ServingError(400, f"unknown model {model[:80]!r}",
                           f"Use one of {self.model_names()} (GET /v1/models lists them).")

    # --- requests ---------------------------------------------------------------------------
    def max_prompt_chars(self) -> int:
        """Longest prompt text (characters) worth tokenising: anything longer cannot fit."""
        return self.max_model_len * PROMPT_CHARS_PER_TOKEN

    def complete(self, request: CompletionRequest, engine: Engine | None = None) -> Served:
        """Generates on `engine` (picked from request.model when not given) and records."""
        engine = engine or self.pick_engine(request.model)
        self._check_fits(request)
        start = time.perf_counter()
        try:
            completions = engine.generate([request.prompt_ids], n=request.n, sampling=request.sampling)
        except Exception as exc:
            raise _engine_failed(exc) from exc
        return self._record(request, engine, completions, start)

    async def acomplete(self, request: CompletionRequest, engine: Engine | None = None) -> Served:
        """`complete` for the event loop: an engine that batches (vllm-async) runs this request
        in the same engine steps as every other one in flight; the others run one at a time."""
        engine = engine or self.pick_engine(request.model)
        self._check_fits(request)
        start = time.perf_counter()
        try:
            completions = await engine.agenerate([request.prompt_ids], n=request.n, sampling=request.sampling)
        except Exception as exc:
            raise _engine_failed(exc) from exc
        return self._record(request, engine, completions, start)

    def _check_fits(self, request: CompletionRequest) -> None:
        if len(request.prompt_ids) + request.sampling.max_tokens > self.max_model_len:
            raise ServingError(
                400, f"the prompt is {len(request.prompt_ids)} tokens and max_tokens is "
                f"{request.sampling.max_tokens}; the context holds {self.max_model_len}",
                "Shorten the prompt or lower max_tokens.")

    def _record(self, request: CompletionRequest, engine: Engine, completions: list[Completion],
                start: float) -> Served:
        # Each completion names the version that produced it (an engine swaps only between
        # requests), which may be newer than `engine.version` was when the request was picked.
        version = completions[0].version if completions else engine.version
        _observe(start, completions, version)
        ids = [f"traj_{uuid.uuid4().hex}" for _ in completions]
        if self.recorder is not None:
            (request.record or self.recorder.put)([self._trajectory(request, c, t, engine.tokenizer)
                                                   for c, t in zip(completions, ids, strict=True)])
        return Served(completions, ids, version)

    def _trajectory(self, request: CompletionRequest, c: Completion, trajectory_id: str,
                    tokenizer: Any) -> dict[str, Any]:
        return {
            "type": "trajectory", "id": trajectory_id, "policy_version": c.version, "task": request.task,
            "prompt": request.messages, "steps": [self.step_of(request, c, trajectory_id, tokenizer)],
            "occurred_at": datetime.now(tz=UTC).isoformat(), **({"user": request.user} if request.user else {}),
        }

    def step_of(self, request: CompletionRequest, c: Completion, trajectory_id: str, tokenizer: Any) -> dict[str, Any]:
        """The assistant step a completion is recorded as: what was sampled, in which context, by
        which version."""
        # PostgreSQL text cannot hold NUL; the token ids keep the exact sample.
        return {"role": "assistant", "content": c.text.replace("\x00", "\ufffd"), "token_ids": c.token_ids,
                "logprobs": c.logprobs, "routing": c.routing, "prompt_token_ids": c.prompt_token_ids,
                "tokens": [t.replace("\x00", "\ufffd") for t in token_texts(tokenizer, c.token_ids)],
                "finish_reason": c.finish_reason, "policy_version": c.version,
                "sampling": {"temperature": request.sampling.temperature, "top_p": request.sampling.top_p},
                **(request.step_fields(c, trajectory_id) if request.step_fields else {})}

    # --- weights ----------------------------------------------------------------------------
    def load_version(self, folder: str | Path, version: int) -> None:
        """Production becomes `version`; requests in flight finish on the old weights. An adapter
        over the host's base is staged under a new name, probed, then served (the old adapter
        unloaded); full weights swap in place, and are swapped back if the probe refuses them."""
        folder = Path(folder)
        with self._swap_lock:
            if (self.host is not None and is_adapter_folder(folder)) or isinstance(self.engine, AdapterView):
                staged = self.engine_for(folder, version)
                self._verified(staged, folder, version, "production")
                old, self.engine = self.engine, staged
                old.close()
            else:
                before = (self.folders["production"], self.engine.version)
                self.engine.load_weights(folder, version)
                try:
                    self._check(self.engine, folder, version, "production")
                except ServingError:
                    self.engine.load_weights(*before)
                    raise
            self.folders["production"] = folder

    def _verified(self, staged: Engine, folder: Path, version: int, role: str) -> None:
        """Probes a staged engine; closes it (an adapter: unloaded) when refused."""
        try:
            self._check(staged, folder, version, role)
        except BaseException:
            staged.close()
            raise

    def _check(self, engine: Engine, folder: Path, version: int, role: str) -> None:
        if self.verify is not None:
            self.verify(engine, folder, version, role)

    def set_canary(self, engine: Engine | None, share: float) -> None:
        with self._swap_lock:
            old, self.canary, self.canary_share = self.canary, engine, share if engine else 0.0
        if old is not None and old is not engine:
            old.close()

    def adapters(self) -> list[dict[str, Any]]:
        """The adapters this server's versions are served as: role, version, the name in the host."""
        roles = (("production", self.engine), ("canary", self.canary))
        return [{"role": role, "version": e.version, "name": e.adapter}
                for role, e in roles if isinstance(e, AdapterView) and e.adapter is not None]

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """{"version": N} swaps production; {"canary": N, "share": s} loads a canary; {"canary": null}
        drops it. Returns what is served now."""
        if "version" in body:
            number = _version_number(body["version"])
            self.load_version(self.resolve(number, "production"), number)
        if "canary" in body:
            if body["canary"] is None:
                self.set_canary(None, 0.0)
            else:
                share = body.get("share", 0.1)
                if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share < 1:
                    raise ServingError(400, "'share' must be a fraction in (0, 1)", "Send e.g. {\"share\": 0.1}.")
                number = _version_number(body["canary"])
                folder = self.resolve(number, "canary")
                if self.canary_share_of is not None:  # the database's share, handed in
                    share = self.canary_share_of(number, float(share))
                staged = self.engine_for(folder, number)
                self._verified(staged, Path(folder), number, "canary")
                self.set_canary(staged, float(share))
        return {"version": self.engine.version, "canary": self.canary.version if self.canary else None,
                "canary_share": self.canary_share}

    def engine_for(self, folder: str | Path, version: int) -> Engine:
        """An adapter over the host's base: a view of the host under a new adapter name. Full
        weights: a second engine built like the first (same kind and settings)."""
        if self.host is not None and is_adapter_folder(folder):
            return AdapterView(self.host, folder, version)
        if self.engines is None:
            raise ServingError(409, "this serving process cannot build a second engine",
                               "Start it with `manage.py serve_policy`, which sets the engine factory.")
        return self.engines(folder, version)

    def close(self) -> None:
        for hook in self.on_close:
            hook()
        if self.recorder is not None:
            self.recorder.close()
        self.engine.close()
        if self.canary is not None:
            self.canary.close()


# tokenizer -> {token id: its text alone}: a token's own text never changes, and decoding token by
# token (the recorded `tokens`, the answer's log-probs) was the largest per-token cost of the
# serving process's request path.
_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
_TOKEN_TEXTS_LOCK = threading.Lock()


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """`tokenizer.decode([t])` of each token id, each id decoded once per tokenizer."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        with _TOKEN_TEXTS_LOCK:
            texts = _TOKEN_TEXTS.setdefault(tokenizer, {})
    out = []
    for t in token_ids:
        text = texts.get(t)
        if text is None:
            text = texts[t] = tokenizer.decode([t])
        out.append(text)
    return out


def _observe(start: float, completions: list[Completion], version: int) -> None:
    elapsed = time.perf_counter() - start
    metrics.SERVING_GENERATE.observe(elapsed)
    metrics.SERVING_TTFT.observe(elapsed)
    metrics.SERVING_TOKENS.labels(str(version)).inc(sum(len(c.token_ids) for c in completions))


def _engine_failed(exc: Exception) -> ServingError:
    log.error("generation failed", exc_info=exc)
    return ServingError(503, f"the engine failed: {type(exc).__name__}", "Retry; if it persists, "
                        "restart the serving process (manage.py serve_policy).")


def default_summary_budget(max_model_len: int) -> int:
    """Three quarters of the context: room left for the summary request and the summary itself."""
    return max_model_len * 3 // 4


def summary_budget_of(value: Any, max_model_len: int) -> int:
    """A checked summary budget: 0 (off) or a token count below the context length."""
    if type(value) is not int or not 0 <= value < max_model_len:
        raise ServingError(400, f"the summary budget must be 0 (off) or 1 to {max_model_len - 1} tokens (below the "
                           f"context length {max_model_len}), got {repr(value)[:40]}",
                           f"Pass e.g. --summary-budget {default_summary_budget(max_model_len)} (the default: 3/4 of "
                           "--max-model-len), or 0 to never summarize conversations.")
    return value


def _version_number(value: Any) -> int:
    if type(value) is not int:
        raise ServingError(400, "'version' must be an integer policy version number", "Send {\"version\": 3}.")
    return value


# The process-wide server, set by `serve_policy` (or by tests) before requests arrive; a process
# serving several projects (serve_policy --project A --project B) sets SERVERS, one per project
# slug, and SERVER to the first.
SERVER: PolicyServer | None = None
SERVERS: dict[str, PolicyServer] = {}


def servers() -> dict[str, PolicyServer]:
    """Every project this process serves, by slug."""
    if SERVERS:
        return SERVERS
    return {SERVER.project_slug: SERVER} if SERVER is not None else {}


def current(project_slug: str | None = None) -> PolicyServer:
    """The server of `project_slug` (None: the process's only, or first, project). A project this
    process does not serve is a 403: the key is valid, for another process."""
    if SERVER is None and not SERVERS:
        raise ServingError(503, "no policy is loaded in this serving process",
                           "Start it with `manage.py serve_policy --project SLUG`.")
    if project_slug is None:
        return SERVER if SERVER is not None else next(iter(SERVERS.values()))
    server = servers().get(project_slug)
    if server is None:
        raise ServingError(403, "this key belongs to a project this serving process does not serve",
                           "Use a key of a project it serves (GET /v1/models with that key names its models), "
                           "or send the request to that project's serving process.")
    return server
