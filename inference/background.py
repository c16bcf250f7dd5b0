"""Group rollouts for training runs on a serving replica's idle capacity (off-peak rollouts).

    manage.py serve_policy --project SLUG --background-rollouts 16     # K = 16; 0 (default): off
    .venv/bin/python bench/offpeak.py --json

A replica started with a background capacity K > 0 takes group-rollout jobs from training runs
(POST /internal/rollouts, inference/background_apis.py) and samples them only in the room its
users leave. The admission rule:

- live first: every live request (a POST under /v1/ on the public listener) is counted by
  `LiveLoad` from its arrival to its answer; background sampling steps only while none is in
  flight (`may_sample`). A user who arrives mid-chunk pauses it before its next decode step (the
  background engine's forward waits, `BackgroundEngine`), so a live request waits at most one
  background decode step;
- at most K background sequences: a job's prompts are sampled in chunks of at most K rows
  (`chunks`; a prompt's G samples are never split), one chunk at a time;
- given back: a job has a deadline; prompts not sampled by then (users kept the replica busy)
  come back in `returned`, and the run samples them itself. A chunk paused past the deadline is
  dropped whole (its rows are returned), so a busy replica never holds a run back.

Weights: the run pushes the weights it wants sampled (PUT /internal/rollouts/weights with an id:
the run and its round), whether they are a registered version or a round's in-progress weights;
the replica holds one such set in a second engine, a torch engine built from the served folder's
config and tokenizer (`BackgroundEngine`). Production's engine (and its canary) is never touched,
so background rollouts come from the run's weights, not production, whenever they differ. The
torch engine is the one a run samples its own rollouts with (`exact=False`: the log-probs the
tokens were drawn from, the run's mu and pi_old), so a row sampled here is the row the run would
have sampled: each (prompt, sample) draws from its own RNG stream keyed by its index in the job.

vLLM's request priority was the first candidate: vLLM 0.32's async engine takes `priority` with
`scheduling_policy="priority"`, but that orders only its waiting queue and picks whom to preempt
when KV blocks run out: a background sequence already running keeps its slot in every batch (and
lengthens every step) when users arrive, and it works inside one engine, while background
rollouts run on other weights than production's.

No Django here: the serving process's views (inference/background_apis.py) and `serve_policy`
drive it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.engines import Completion, SamplingParams, TorchEngine
from inference.engines.openmp import release_team

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- the rule


def may_sample(live_in_flight: int) -> bool:
    """Background sampling steps only while no live request is in flight: live always first."""
    return live_in_flight == 0


def chunks(prompts: int, n: int, slots: int) -> list[tuple[int, int]]:
    """(first prompt, prompts) of each chunk: at most `slots` sequences (prompts x n) at once, at
    least one prompt (its n samples share one prefill, so they are never split)."""
    per = max(1, slots // max(1, n))
    return [(start, min(per, prompts - start)) for start in range(0, prompts, per)]


# --------------------------------------------------------------------------------- live load


class LiveLoad:
    """Live requests in flight in this process, and the seconds with at least one in flight."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._waiting = 0  # samplers blocked in wait_room
        self._busy_since: float | None = None
        self._busy_s = 0.0

    def enter(self) -> None:
        with self._cond:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                assert self._busy_since is not None
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
                self._cond.notify_all()

    def in_flight(self) -> int:
        return self._in_flight

    def waiting(self) -> int:
        """How many samplers are blocked in `wait_room` now (paused for users)."""
        return self._waiting

    def busy_s(self) -> float:
        with self._cond:
            now = time.monotonic()
            return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def wait_room(self, until: float | None = None, stop: threading.Event | None = None) -> bool:
        """Blocks while users are served; False when `until` (monotonic) passed or `stop` is set first."""
        with self._cond:
            while not may_sample(self._in_flight):
                left = None if until is None else until - time.monotonic()
                if (left is not None and left <= 0) or (stop is not None and stop.is_set()):
                    return False
                self._waiting += 1
                try:
                    self._cond.wait(0.25 if left is None else min(left, 0.25))
                finally:
                    self._waiting -= 1
            return not (stop is not None and stop.is_set())

    @contextmanager
    def request(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()


# The process's live load: the public listener's middleware counts into it
# (inference/background_apis.py `LiveRequestsMiddleware`).
LIVE = LiveLoad()


# --------------------------------------------------------------------------------- the engine


class GaveBack(Exception):
    """A paused chunk outlived its job's deadline (or the replica is stopping): its rows go back."""


class _Paused:
    """The fused decoder with a gate before every forward (the decode step's boundary)."""

    def __init__(self, inner: Any, engine: BackgroundEngine) -> None:
        self._inner, self._engine = inner, engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._engine.gate()
        self._engine.steps += 1
        return self._inner.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BackgroundEngine(TorchEngine):
    """The torch engine as a run samples with (exact=False) whose decode steps wait for room, and
    whose rows draw from the RNG stream of their index in the whole job (`prompt_offset`), so a
    job cut into chunks samples what one `generate` of all its prompts would."""

    def __init__(self, model_dir: str | Path, *, version: int = 0, seed: int = 0, max_model_len: int = 512) -> None:
        super().__init__(model_dir, version=version, seed=seed, max_model_len=max_model_len, exact=False)
        self.prompt_offset = 0
        self.gate: Callable[[], None] = lambda: None
        self.steps = 0  # decode steps run (forwards of the fused decoder)

    def _decoder(self) -> Any:
        inner = super()._decoder()
        return None if inner is None else _Paused(inner, self)

    def _generator(self, prompt_index: int, sample_index: int, sampling: SamplingParams) -> Any:
        return super()._generator(prompt_index + self.prompt_offset, sample_index, sampling)

    def sample_chunk(self, prompts: list[list[int]], offset: int, n: int, sampling: SamplingParams,
                     gate: Callable[[], None], first: int = 0) -> list[Completion]:
        """n samples of each prompt, indexed from `offset` in the job (prompt_index is the job's);
        their RNG streams are those of indices from `first + offset` (the job's prompts being the
        run's from `first` on)."""
        with self._lock:
            self.prompt_offset, self.gate = first + offset, gate
            try:
                out = self._generate(self._encode(prompts), n, sampling)
            finally:
                self.prompt_offset, self.gate = 0, lambda: None
        for c in out:
            c.prompt_index += offset
        return out


# --------------------------------------------------------------------------------- jobs


class UnknownWeights(Exception):
    """A job names weights this replica does not hold (push them first)."""


@dataclass
class RolloutJob:
    weights: str  # the id the run pushed its weights under
    prompts: list[list[int]]  # token ids
    n: int
    sampling: SamplingParams
    deadline: float  # monotonic: prompts not sampled by then are returned
    first: int = 0  # the index of the job's first prompt among the run's (its rows' RNG streams)
    done: list[Completion] = field(default_factory=list)
    returned: list[int] = field(default_factory=list)
    future: Future = field(default_factory=Future)
    sampled_s: float = 0.0

    def answer(self, version: int) -> dict[str, Any]:
        return {"weights": self.weights, "version": version, "sampled_s": round(self.sampled_s, 4),
                "returned": self.returned,
                "completions": [{"prompt_index": c.prompt_index, "token_ids": c.token_ids, "logprobs": c.logprobs,
                                 "finish_reason": c.finish_reason, "text": c.text} for c in self.done]}


class BackgroundRollouts:
    """One replica's background rollouts: the held weights (a second engine), a queue of jobs and
    the thread that samples them in the room `live` leaves."""

    def __init__(self, base_dir: str | Path, slots: int, *, live: LiveLoad = LIVE, max_model_len: int = 512,
                 max_queued: int = 64) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"background slots must be a positive integer, got {slots!r}")
        self.base_dir, self.slots, self.live, self.max_model_len = Path(base_dir), slots, live, max_model_len
        self.weights: str | None = None  # the id of the held weights
        self.held_hash: str | None = None  # their checkpoint hash (kernels.delta): a delta's parent
        self.held_keys: list[str] = []
        self.engine: BackgroundEngine | None = None
        # Jobs and weight pushes, in order, for the sampling thread; at most max_queued jobs.
        self._work: queue.Queue[RolloutJob | tuple[Callable[[], None], Future]] = queue.Queue()
        self._queued, self.max_queued = 0, max_queued
        self._queue_lock = threading.Lock()
        self._held = threading.Lock()  # a weights push waits for the chunk sampling on the old ones
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.rollouts = 0  # sequences sampled, all jobs
        self._busy_s = 0.0
        self._window = (time.monotonic(), 0.0)  # (wall, busy) at the last `window_share`

    # --- weights ------------------------------------------------------------------------------
    def put_weights(self, weights: str, version: int, data: bytes, encoding: str = "safetensors") -> None:
        """Holds `data` as `weights`, replacing the set held: safetensors of the whole model (HF
        names), or with encoding "delta" a `kernels.delta` blob against the set held now (its
        parent hash must be the held set's: CheckpointCorrupt otherwise, and nothing changes).

        Once the sampling thread runs, the work is done there (after the job it is sampling):
        every torch parallel region of the background engine then comes from one thread. Each
        thread that runs one keeps an OpenMP team of its own, and with more team threads alive
        than cores, GNU OpenMP stops spin-waiting between regions, so every decode step paid a
        futex wake-up (bench/offpeak.py: the replica sampled a call 23% slower than a worker).
        The sampling thread also frees its team whenever it waits (for users, or for work):
        inference/engines/openmp.py."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self._put_weights(weights, version, data, encoding)
        call: Future = Future()
        self._work.put((lambda: self._put_weights(weights, version, data, encoding), call))
        return call.result()

    def _put_weights(self, weights: str, version: int, data: bytes, encoding: str) -> None:
        from safetensors.torch import load

        from kernels.delta import CheckpointCorrupt, checkpoint_hash, decode, read_manifest

        with self._held:
            if encoding == "delta":
                if self.engine is None or self.held_hash is None:
                    raise CheckpointCorrupt("this replica holds no weights to apply a delta to")
                current = self.engine.model.state_dict()
                parent = {k: current[k] for k in self.held_keys}
                state, held_hash = decode(data, parent, parent_hash=self.held_hash), read_manifest(data)["checkpoint_hash"]
            else:
                state = load(data)
                held_hash = checkpoint_hash(state)
            if self.engine is None:
                self.engine = BackgroundEngine(self.base_dir, version=version, max_model_len=self.max_model_len)
            self.engine.load_weights(state, version)
            self.weights, self.held_hash, self.held_keys = weights, held_hash, sorted(state)

    # --- jobs ---------------------------------------------------------------------------------
    def submit(self, job: RolloutJob) -> Future:
        """Queues `job`; its future gets `RolloutJob.answer`, or UnknownWeights / queue.Full at once."""
        if job.weights != self.weights:
            raise UnknownWeights(job.weights)
        with self._queue_lock:
            if self._queued >= self.max_queued:
                raise queue.Full
            self._queued += 1
        self._work.put(job)
        return job.future

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="background-rollouts", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(30)
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, RolloutJob):
                _call(*item)  # a weights push: done here, the thread has stopped
                continue
            item.returned = list(range(len(item.prompts)))
            if item.future.set_running_or_notify_cancel():  # its caller may have gone
                item.future.set_result(item.answer(0))

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._work.get(timeout=0.25)
            except queue.Empty:
                continue
            try:
                self._take(job)
            finally:
                release_team()  # idle until the next: its OpenMP team freed, beside the live engine's

    def _take(self, job: RolloutJob | tuple[Callable[[], Any], Future]) -> None:
        if not isinstance(job, RolloutJob):
            _call(*job)
            return
        with self._queue_lock:
            self._queued -= 1
        # A caller that went away (its request cancelled the future) before its job started:
        # skipped. Once running, the future can no longer be cancelled, so its answer is set.
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self.run(job))
        except Exception as exc:  # noqa: BLE001 - the run gets the failure, the replica goes on
            log.warning("background rollout job failed", exc_info=True)
            job.future.set_exception(exc)

    def run(self, job: RolloutJob) -> dict[str, Any]:
        """Samples `job` chunk by chunk in the room users leave; what the deadline cuts off is returned."""
        with self._held:
            if job.weights != self.weights or self.engine is None:
                raise UnknownWeights(job.weights)
            engine = self.engine
            for offset, count in chunks(len(job.prompts), job.n, self.slots):
                if not may_sample(self.live.in_flight()):
                    release_team()
                if not self.live.wait_room(job.deadline, self._stopping):
                    job.returned += range(offset, len(job.prompts))
                    break
                try:
                    job.done += self._chunk(engine, job, offset, count)
                except GaveBack:
                    job.returned += range(offset, len(job.prompts))
                    break
            return job.answer(engine.version)

    def _chunk(self, engine: BackgroundEngine, job: RolloutJob, offset: int, count: int) -> list[Completion]:
        paused = [0.0]

        def gate() -> None:
            if may_sample(self.live.in_flight()):
                return
            release_team()  # paused for users: no idle workers of this thread beside the live engine's
            start = time.monotonic()
            ok = self.live.wait_room(job.deadline, self._stopping)
            paused[0] += time.monotonic() - start
            if not ok:
                raise GaveBack

        start = time.monotonic()
        out = engine.sample_chunk(job.prompts[offset: offset + count], offset, job.n, job.sampling, gate, job.first)
        spent = time.monotonic() - start - paused[0]
        job.sampled_s += spent
        self._busy_s += spent
        self.rollouts += len(out)
        return out

    # --- what the registry shows -----------------------------------------------------------------
    def window_share(self) -> float:
        """The share of wall time spent sampling background rollouts since the last call."""
        now, busy = time.monotonic(), self._busy_s
        wall0, busy0 = self._window
        self._window = (now, busy)
        return min(1.0, (busy - busy0) / (now - wall0)) if now > wall0 else 0.0

    def status(self) -> dict[str, Any]:
        return {"slots": self.slots, "weights": self.weights, "queued": self._queued,
                "rollouts": self.rollouts, "busy_s": round(self._busy_s, 3),
                "live_in_flight": self.live.in_flight()}


def _call(fn: Callable[[], None], done: Future) -> None:
    """Runs a weights push queued for the sampling thread; its caller gets the outcome."""
    try:
        fn()
        done.set_result(None)
    except Exception as exc:  # noqa: BLE001 - the push's caller gets the failure
        done.set_exception(exc)


# The process's background rollouts, set by `serve_policy --background-rollouts K` (None: off).
WORKER: BackgroundRollouts | None = None
