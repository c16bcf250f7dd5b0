"""A training run's group rollouts on its project's serving replicas (off-peak rollouts).

`ReplicaSampler.generate(prompts, n, sampling, weights=..., state=...)` is `Engine.generate` for a
run: the prompts are split among the live replicas that take background rollouts (their row's
`background_slots` > 0: `serve_policy --background-rollouts K`), each is sent the weights the run
wants sampled (PUT /internal/rollouts/weights, once per replica and weights id: a registered
version or a round's in-progress weights alike) and its share of the prompts (POST /internal/rollouts, with a deadline). What a replica gives back (its users kept
it busy past the deadline), or could not take (down, full, refused), is sampled by the run's own
engine, so a run never waits on a busy replica. The replicas' sampling is live-first and
admission-bounded (inference/background.py).

Weights go as a `kernels.delta` blob against the set the replica holds from this sampler (the
checkpoint store's codec: XOR planes, zstd, verified on decode against the parent's hash), the
whole state dict as safetensors only for a replica's first push or when it holds something else
(it answers 409 and gets the whole set). The sampler keeps a copy of the last weights it sent
(one model's bytes in the run's process) to encode the next round's delta against.

A replica's rows draw from the RNG stream of their index in the whole call, as the run's own
engine would: on the same weights, the same tokens (the log-probs within float rounding).

    .venv/bin/python -m pytest tests/training/replicas/test_background_rollouts.py -q
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from django.conf import settings

from inference.engines import Completion, Engine, SamplingParams
from inference.tokens import replica_token
from training.models import ServingReplica
from training.replicas.selectors import replicas_live

log = logging.getLogger(__name__)

ROLLOUTS_PATH = "/internal/rollouts"
WEIGHTS_PATH = "/internal/rollouts/weights"
DEADLINE_S = 120.0  # what a replica has for its share before the rest comes back to the run


def replicas_taking_rollouts(project_id: int) -> list[ServingReplica]:
    """Live replicas of the project whose background rollouts are on."""
    return list(replicas_live(project_id).filter(background_slots__gt=0))


@dataclass
class Share:
    replica: ServingReplica
    indices: list[int]  # the call's prompt indices sent to it
    completions: list[Completion] = field(default_factory=list)
    back: list[int] = field(default_factory=list)  # returned, or never taken
    error: str = ""


class ReplicaSampler:
    """Samples on replicas first, on `local` (the run's own engine) for what they give back."""

    def __init__(self, replicas: Sequence[ServingReplica], local: Engine, token: str,
                 deadline_s: float = DEADLINE_S, timeout_s: float = 600.0) -> None:
        self.replicas, self.local, self.token = list(replicas), local, token
        self.deadline_s, self.timeout_s = deadline_s, timeout_s
        self.pushed: dict[int, str] = {}  # replica id -> the weights id it holds from us
        self.held: dict[int, str] = {}  # replica id -> the checkpoint hash of what it holds from us
        self.sent: _Sent | None = None  # the last weights sent (a delta's parent)
        self.on_replicas = 0  # rollouts the replicas sampled
        self.given_back = 0  # rollouts the run's own engine sampled instead
        self.errors: list[str] = []
        self.calls: list[dict[str, float]] = []  # per replica call: push and round-trip seconds, bytes
        # One HTTP client per replica for the sampler's life: its connection is reused, and a new
        # client costs ~20 ms of CPU (its TLS context), as much as a call's sampling on a small model.
        self._clients: dict[int, httpx.Client] = {}
        self._clients_lock = threading.Lock()

    @classmethod
    def setup(cls, project_id: int, local: Engine) -> ReplicaSampler | None:
        """A sampler over the project's replicas taking rollouts; None when there is none (or no
        internal token to reach them)."""
        replicas = replicas_taking_rollouts(project_id)
        if not replicas or not settings.FLYWHEEL_INTERNAL_TOKEN:
            return None
        return cls(replicas, local, settings.FLYWHEEL_INTERNAL_TOKEN)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *, weights: str,
                 state: Mapping[str, torch.Tensor], version: int) -> list[Completion]:
        """n completions per prompt (grouped by prompt, as Engine.generate) from `state`, whose id
        is `weights`; `local` must hold the same weights (it samples what comes back)."""
        prompts = [list(p) for p in prompts]
        shares = [Share(r, list(part)) for r, part in zip(self.replicas, _slices(len(prompts), len(self.replicas)),
                                                            strict=True) if part]
        payload = _Payload(weights, state, self.sent)
        if len(shares) == 1:
            self._send(shares[0], prompts, n, sampling, version, payload)
        else:
            with ThreadPoolExecutor(max_workers=len(shares)) as pool:
                list(pool.map(lambda s: self._send(s, prompts, n, sampling, version, payload), shares))
        if payload.current is not None:
            self.sent = payload.current
        out = [c for s in shares for c in s.completions]
        back = sorted(i for s in shares for i in s.back)
        self.errors += [f"{s.replica.address}: {s.error}" for s in shares if s.error]
        self.on_replicas += len(out)
        if back:
            local = self.local.generate([prompts[i] for i in back], n=n, sampling=sampling)
            for c in local:
                c.prompt_index = back[c.prompt_index]
            self.given_back += len(local)
            out += local
        return sorted(out, key=lambda c: c.prompt_index)

    def _send(self, share: Share, prompts: list[list[int]], n: int, sampling: SamplingParams, version: int,
              payload: _Payload) -> None:
        replica, weights = share.replica, payload.weights
        base = replica.address.rstrip("/")
        sent = [prompts[i] for i in share.indices]
        timing = {"push_s": 0.0, "push_bytes": 0.0}
        try:
            http = self._client(replica)
            if self.pushed.get(replica.id) != weights:
                start = time.perf_counter()
                self._push(http, base, replica.id, version, payload, timing)
                timing["push_s"] = time.perf_counter() - start
            start = time.perf_counter()
            answer = _ok(http.post(base + ROLLOUTS_PATH, json={
                "weights": weights, "prompts": sent, "n": n, "deadline_s": self.deadline_s,
                "first_index": share.indices[0],
                "sampling": {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed}})).json()
            timing.update(round_trip_s=time.perf_counter() - start, sampled_s=float(answer.get("sampled_s", 0.0)))
        except (httpx.HTTPError, ReplicaRefused) as exc:
            log.warning("background rollouts on %s failed: %s", replica.address, exc)
            share.back, share.error = list(share.indices), f"{type(exc).__name__}: {exc}"[:500]
            self.pushed.pop(replica.id, None)
            self.held.pop(replica.id, None)
            if isinstance(exc, httpx.TransportError):
                self._drop_client(replica.id)  # the next call connects afresh
            return
        self.calls.append(timing)
        share.completions = [_completion(c, share.indices, sent, int(answer["version"])) for c in answer["completions"]]
        share.back = [share.indices[i] for i in answer["returned"]]

    def _push(self, http: httpx.Client, base: str, replica_id: int, version: int, payload: _Payload,
              timing: dict[str, float]) -> None:
        """The weights as a delta against what the replica holds from us, else (first push, or
        it refused the delta: 409) whole."""
        params = {"id": payload.weights, "version": version}
        parent = self.held.get(replica_id)
        delta = payload.delta(parent)
        response = None
        if delta is not None:
            response = http.put(base + WEIGHTS_PATH, params={**params, "encoding": "delta"}, content=delta)
            timing["push_bytes"] = len(delta)
        if response is None or response.status_code == 409:
            whole = payload.whole()
            response = http.put(base + WEIGHTS_PATH, params=params, content=whole)
            timing["push_bytes"] += len(whole)
        _ok(response)
        self.pushed[replica_id], self.held[replica_id] = payload.weights, payload.sent().hash

    def _client(self, replica: ServingReplica) -> httpx.Client:
        with self._clients_lock:
            http = self._clients.get(replica.id)
            if http is None:
                headers = {"Authorization": f"Bearer {replica_token(self.token, replica.address)}"}
                http = self._clients[replica.id] = httpx.Client(timeout=self.timeout_s, headers=headers)
            return http

    def _drop_client(self, replica_id: int) -> None:
        with self._clients_lock:
            http = self._clients.pop(replica_id, None)
        if http is not None:
            http.close()

    def close(self) -> None:
        """Closes the connections to the replicas (a later call opens new ones)."""
        for replica_id in list(self._clients):
            self._drop_client(replica_id)

    def report(self) -> dict[str, Any]:
        return {"rollouts_on_replicas": self.on_replicas, "rollouts_given_back": self.given_back,
                "rollout_replicas": [r.address for r in self.replicas], "rollout_replica_errors": self.errors[:10]}


@dataclass
class _Sent:
    state: dict[str, torch.Tensor]  # a copy: the run trains the model whose state_dict it passes
    hash: str  # kernels.delta checkpoint hash


class _Payload:
    """One call's weights, encoded at most once whole and once as a delta, whichever replicas need."""

    def __init__(self, weights: str, state: Mapping[str, torch.Tensor], previous: _Sent | None) -> None:
        self.weights, self.state, self.previous = weights, state, previous
        self.current: _Sent | None = None
        self._lock = threading.Lock()
        self._whole: bytes | None = None
        self._delta: bytes | None = None

    def sent(self) -> _Sent:
        from kernels.delta import checkpoint_hash

        with self._lock:
            if self.current is None:
                copy = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.state.items()}
                self.current = _Sent(copy, checkpoint_hash(copy))
            return self.current

    def whole(self) -> bytes:
        from safetensors.torch import save

        current = self.sent()
        with self._lock:
            if self._whole is None:
                self._whole = save(current.state)
            return self._whole

    def delta(self, parent_hash: str | None) -> bytes | None:
        """A delta against the previous weights when the replica holds exactly those."""
        from kernels.delta import encode

        if self.previous is None or parent_hash != self.previous.hash:
            return None
        current = self.sent()
        with self._lock:
            if self._delta is None:
                self._delta = encode(current.state, self.previous.state, parent_hash=self.previous.hash)
            return self._delta


class ReplicaRefused(Exception):
    """A replica answered with an error (its message and fix)."""


def _ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        try:
            error = response.json()["error"]
            reason = f"{error['message']}. {error.get('fix', '')}"
        except (ValueError, KeyError, TypeError):
            reason = response.text[:300]
        raise ReplicaRefused(f"{response.status_code}: {reason}")
    return response


def _slices(count: int, parts: int) -> list[range]:
    """`count` indices cut into `parts` contiguous slices of near-equal size (a replica's rows keep
    their index in the call: the RNG streams the run's own engine would give them)."""
    size, extra = divmod(count, parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def _completion(c: dict[str, Any], indices: list[int], sent: list[list[int]], version: int) -> Completion:
    """A replica's answer row as the run's Completion (prompt index back in the run's numbering)."""
    local = int(c["prompt_index"])
    return Completion(indices[local], list(sent[local]), list(c["token_ids"]), [float(x) for x in c["logprobs"]],
                      "stop" if c["finish_reason"] == "stop" else "length", str(c["text"]), version)
