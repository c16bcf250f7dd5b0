"""Background rollouts on a serving replica (inference/background.py): live requests first, at
most K background sequences, what a busy replica gives back, and the result path over the
internal listener (the weights the run pushed, with their behaviour log-probs).

Real parts: the torch engine on the tiny dense policy, safetensors, the internal and public
listeners as serve_policy builds them (uvicorn in a thread).

    .venv/bin/python -m pytest tests/inference/test_background.py -q
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from django.test import override_settings
from safetensors.torch import save

from inference import background
from inference.background import BackgroundRollouts, LiveLoad, RolloutJob, chunks, may_sample
from inference.engines import SamplingParams, make_engine
from inference.listeners import INTERNAL_URLS, PUBLIC_URLS, listener_app
from tests.inference.conftest import hf_logprobs
from tests.processes import InThreadServer, wait_until
from training.pretrain import perturbed_state_dict

TOKEN = "background-test-token"
SAMPLING = SamplingParams(max_tokens=12, seed=5)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(p) as f:"]


def _ids(folder: Path) -> list[list[int]]:
    tok = make_engine("torch", folder).tokenizer
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


def _worker(folder: Path, slots: int, live: LiveLoad, weights: dict[str, torch.Tensor] | None = None
            ) -> BackgroundRollouts:
    worker = BackgroundRollouts(folder, slots, live=live)
    worker.put_weights("run-1-round-0", 1, save(weights or _state(folder)))
    worker.start()
    return worker


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in make_engine("torch", folder).model.state_dict().items()}


def _job(prompts: list[list[int]], n: int = 2, deadline_s: float = 120.0) -> RolloutJob:
    return RolloutJob("run-1-round-0", prompts, n, SAMPLING, deadline=time.monotonic() + deadline_s)


def test_background_samples_only_while_no_live_request_is_in_flight():
    assert may_sample(0)
    assert not may_sample(1) and not may_sample(7)


def test_a_chunk_holds_at_most_k_sequences_and_never_splits_a_prompts_group():
    assert chunks(5, 2, 4) == [(0, 2), (2, 2), (4, 1)]
    assert chunks(3, 8, 4) == [(0, 1), (1, 1), (2, 1)]  # G > K: one prompt's G at a time
    assert chunks(4, 1, 16) == [(0, 4)]
    assert sum(count for _, count in chunks(37, 4, 16)) == 37


def test_a_job_cut_into_chunks_samples_what_one_generate_of_its_prompts_would(dense_dir: Path):
    prompts = _ids(dense_dir)
    worker = _worker(dense_dir, slots=4, live=LiveLoad())
    try:
        answer = worker.submit(_job(prompts)).result(120)
    finally:
        worker.close()
    own = make_engine("torch", dense_dir, exact=False).generate(prompts, n=2, sampling=SAMPLING)
    got = sorted(answer["completions"], key=lambda c: c["prompt_index"])
    assert answer["returned"] == [] and len(got) == len(own) == 10
    for mine, theirs in zip(got, own, strict=True):
        assert mine["prompt_index"] == theirs.prompt_index and mine["token_ids"] == theirs.token_ids
        assert mine["logprobs"] == pytest.approx(theirs.logprobs, abs=1e-5)
    assert worker.rollouts == 10


def test_a_user_who_arrives_pauses_background_sampling_until_answered(dense_dir: Path):
    live = LiveLoad()
    worker = _worker(dense_dir, slots=2, live=live)
    try:
        future = worker.submit(_job(_ids(dense_dir) * 4, n=2))
        wait_until(lambda: worker.engine.steps >= 3, timeout=120, every=0.01, what="sampling to begin")
        live.enter()  # a user's request arrives
        # The step in progress ends, then the sampler blocks until the user is answered.
        wait_until(live.waiting, timeout=60, every=0.005, what="background sampling to pause for the user")
        paused_at = worker.engine.steps
        assert not future.done()
        assert live.waiting() and worker.engine.steps == paused_at, "a background step ran while a user was served"
        live.leave()  # answered: background goes on
        answer = future.result(180)
    finally:
        worker.close()
    assert answer["returned"] == [] and len(answer["completions"]) == 40
    assert worker.engine.steps > paused_at


def test_no_chunk_starts_while_users_are_served_and_the_job_is_given_back_at_its_deadline(dense_dir: Path):
    live = LiveLoad()
    worker = _worker(dense_dir, slots=4, live=live)
    prompts = _ids(dense_dir)
    try:
        live.enter()
        answer = worker.submit(_job(prompts, deadline_s=0.5)).result(60)
        assert answer["completions"] == [] and answer["returned"] == list(range(len(prompts)))
        assert worker.engine.steps == 0
        live.leave()
        assert len(worker.submit(_job(prompts)).result(120)["completions"]) == 10
    finally:
        worker.close()


def test_a_job_whose_caller_went_away_is_skipped_and_the_next_one_is_sampled(dense_dir: Path):
    live = LiveLoad()
    worker = _worker(dense_dir, slots=4, live=live)
    prompts = _ids(dense_dir)
    try:
        live.enter()  # users keep the sampler waiting on the first job while two more queue
        first = worker.submit(_job(prompts[:1], deadline_s=0.5))
        gone = worker.submit(_job(prompts))
        assert gone.cancel()  # its request was cancelled (the run's connection closed) before it started
        after = worker.submit(_job(prompts[:2]))
        first.result(60)
        live.leave()
        assert len(after.result(120)["completions"]) == 4  # the sampler thread lived on
        assert worker.rollouts == 4  # nothing sampled for the cancelled job
    finally:
        worker.close()


def test_a_chunk_paused_past_its_deadline_is_given_back_whole(dense_dir: Path):
    live = LiveLoad()
    worker = _worker(dense_dir, slots=4, live=live)
    prompts = _ids(dense_dir)
    try:
        future = worker.submit(_job(prompts, n=2, deadline_s=3.0))
        wait_until(lambda: worker.engine.steps >= 2, timeout=120, every=0.005, what="sampling to begin")
        live.enter()  # users for the rest of the deadline
        answer = future.result(60)
        live.leave()
    finally:
        worker.close()
    done = {c["prompt_index"] for c in answer["completions"]}
    assert answer["returned"] and done.isdisjoint(answer["returned"])
    assert done | set(answer["returned"]) == set(range(len(prompts)))
    for c in answer["completions"]:  # finished chunks are whole: G samples each
        assert sum(d["prompt_index"] == c["prompt_index"] for d in answer["completions"]) == 2


# --------------------------------------------------------------------------------- over HTTP


@pytest.fixture
def internal(dense_dir: Path):
    background.WORKER = BackgroundRollouts(dense_dir, 8)
    background.WORKER.start()
    server = InThreadServer(listener_app(INTERNAL_URLS))
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=TOKEN):
        yield httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    server.stop()
    background.WORKER.close()
    background.WORKER = None


def test_a_run_gets_rollouts_with_behaviour_logprobs_of_the_weights_it_pushed(internal, dense_dir: Path):
    candidate = {k: v.contiguous() for k, v in perturbed_state_dict(dense_dir, scale=0.5, seed=3).items()}
    pushed = internal.put("/internal/rollouts/weights", params={"id": "run-7-round-1", "version": 4},
                          content=save(candidate))
    assert pushed.status_code == 200, pushed.text
    prompts = _ids(dense_dir)[:3]
    answer = internal.post("/internal/rollouts", json={
        "weights": "run-7-round-1", "prompts": prompts, "n": 2, "sampling": {"max_tokens": 8, "seed": 1}})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["weights"] == "run-7-round-1" and body["version"] == 4 and body["returned"] == []
    assert len(body["completions"]) == 6
    for c in body["completions"]:
        assert len(c["logprobs"]) == len(c["token_ids"]) > 0
        prompt = prompts[c["prompt_index"]]
        ours = hf_logprobs(dense_dir, prompt, c["token_ids"], state_dict=candidate)
        assert c["logprobs"] == pytest.approx(ours.tolist(), abs=1e-4)  # the candidate's, not production's
        served = hf_logprobs(dense_dir, prompt, c["token_ids"])
        assert not torch.allclose(torch.tensor(c["logprobs"]), served, atol=1e-3)
    status = internal.get("/internal/rollouts").json()
    assert status["weights"] == "run-7-round-1" and status["rollouts"] == 6 and status["slots"] == 8


def test_a_job_for_weights_not_pushed_is_refused_with_the_fix(internal, dense_dir: Path):
    refused = internal.post("/internal/rollouts", json={"weights": "run-9-round-0", "prompts": [[1, 2]], "n": 2})
    assert refused.status_code == 409 and "PUT them" in refused.json()["error"]["fix"]
    bad = internal.post("/internal/rollouts", json={"weights": "x", "prompts": [[-1]], "n": 2})
    assert bad.status_code == 400 and bad.json()["error"]["fix"]
    assert internal.put("/internal/rollouts/weights", params={"id": "w", "version": 1},
                        content=b"not safetensors").status_code == 400


def test_a_replica_without_background_rollouts_says_how_to_turn_them_on(dense_dir: Path):
    server = InThreadServer(listener_app(INTERNAL_URLS))
    try:
        with override_settings(FLYWHEEL_INTERNAL_TOKEN=TOKEN):
            off = httpx.get(server.url + "/internal/rollouts", headers={"Authorization": f"Bearer {TOKEN}"})
    finally:
        server.stop()
    assert off.status_code == 409 and "--background-rollouts" in off.json()["error"]["fix"]


def test_the_public_listener_counts_each_live_request_while_it_is_in_flight(monkeypatch):
    live = LiveLoad()
    monkeypatch.setattr(background, "LIVE", live)
    seen: list[int] = []
    enter = live.enter

    def counted() -> None:
        enter()
        seen.append(live.in_flight())

    monkeypatch.setattr(live, "enter", counted)
    server = InThreadServer(listener_app(PUBLIC_URLS))
    try:
        httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": []})  # 503: no policy
        httpx.get(server.url + "/v1/models")  # a read, not a completion: not counted
        threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                    kwargs={"json": {}}) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()
    assert len(seen) == 4 and live.in_flight() == 0 and live.busy_s() > 0


def test_a_weights_push_runs_on_the_sampling_thread_after_the_job_it_is_sampling(dense_dir: Path, monkeypatch):
    # One thread runs all of the background engine's torch work, so the process keeps one OpenMP
    # team for it (a second team throttles every team's spin-wait: bench/offpeak.py).
    live = LiveLoad()
    worker = _worker(dense_dir, slots=4, live=live)
    seen: list[str] = []
    loaded = worker.engine.load_weights
    monkeypatch.setattr(worker.engine, "load_weights",
                        lambda *a, **k: (seen.append(threading.current_thread().name), loaded(*a, **k))[1])
    prompts = _ids(dense_dir)
    try:
        live.enter()  # the first job waits for room
        first = worker.submit(_job(prompts[:2]))
        pushed = threading.Thread(target=worker.put_weights,
                                  args=("run-1-round-1", 2, save(perturbed_state_dict(dense_dir, 1e-3, 3))))
        pushed.start()
        time.sleep(0.3)
        assert worker.weights == "run-1-round-0" and pushed.is_alive()  # queued behind the job
        live.leave()
        assert first.result(60)["weights"] == "run-1-round-0" and len(first.result()["completions"]) == 4
        pushed.join(60)
        assert worker.weights == "run-1-round-1" and seen == ["background-rollouts"]
    finally:
        worker.close()


def test_a_replica_refuses_a_job_past_its_queue_and_takes_one_again_once_a_job_started(dense_dir: Path):
    import queue

    live = LiveLoad()
    worker = BackgroundRollouts(dense_dir, 4, live=live, max_queued=2)
    worker.put_weights("run-1-round-0", 1, save(_state(dense_dir)))
    prompts = _ids(dense_dir)
    jobs = [worker.submit(_job(prompts[:1], n=1)) for _ in range(2)]
    with pytest.raises(queue.Full):
        worker.submit(_job(prompts[:1], n=1))
    live.enter()
    worker.start()  # takes the first job, which waits for room: one place in the queue again
    try:
        wait_until(lambda: worker.status()["queued"] == 1, timeout=30)
        jobs.append(worker.submit(_job(prompts[:1], n=1)))
        live.leave()
        assert [len(j.result(120)["completions"]) for j in jobs] == [1, 1, 1]
    finally:
        worker.close()
