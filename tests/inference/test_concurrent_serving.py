"""Concurrent requests through the real serving process (serve_policy, vllm-async engine).

Engine-side evidence, never timing: vLLM's scheduler reports how many requests ran in each engine
step (flywheel_serving_engine_batch_requests on /metrics), and each recorded trajectory's
behaviour log-probs are checked against the weights of the version it names.
"""

from __future__ import annotations

import re
import threading

import httpx
import pytest
import torch

from feedback.models import Step, Trajectory
from tests.inference.test_serving import TOKEN, _key, _promote, _serve, _stop, _versions
from tests.processes import wait_until

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(p) as f:",
           "def main():", "x = [1, 2, 3]", "return self"]


def _scorer(folder):
    """log_softmax of `tokens` after `prompt` under the weights in `folder` (plain transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # (T, V)
        return logits.float().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # (T,)

    return logprobs


def _batch_histogram(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    found = re.findall(r'^flywheel_serving_engine_batch_requests_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    return {le: float(count) for le, count in found}


def _concurrently(url: str, creds, bodies: list[dict]) -> list[httpx.Response]:
    """Sends every body at once (one thread each, released together)."""
    answers: list[httpx.Response | None] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        with httpx.Client(timeout=300, headers=_key(creds)) as http:
            start.wait()
            answers[i] = http.post(url + "/v1/completions", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(a is not None for a in answers)
    return answers  # type: ignore[return-value]


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_share_engine_steps_and_each_is_recorded(creds, dense_dir, tmp_path):
    _versions(creds.project, dense_dir, tmp_path)
    proc, url, _ = _serve(creds.project.slug, "vllm")
    try:
        before = _batch_histogram(url)
        # Half stop at a newline: this process ends those, so their log-probs come each step;
        # the others' come with their last token (inference/vllm_scheduler.py). Both, one batch.
        bodies = [{"model": "acme", "prompt": p, "max_tokens": 48, "seed": i, "logprobs": 0,
                   **({"stop": ["\n"]} if i % 2 else {})} for i, p in enumerate(PROMPTS)]
        answers = _concurrently(url, creds, bodies)
        assert {a.status_code for a in answers} == {200}
        after = _batch_histogram(url)
        steps = after["+Inf"] - before.get("+Inf", 0)
        alone = after["1.0"] - before.get("1.0", 0)
        assert steps > 0 and steps - alone > 0, "no engine step ran more than one request"
        choices = [a.json()["choices"][0] for a in answers]
    finally:
        _stop(proc)  # shutdown flushes the recorder
    # A graceful stop (SIGTERM): the listeners run on the engine's loop, the main thread takes the signal.
    assert proc.returncode == 0
    stored = {t.external_id: t for t in Trajectory.objects.filter(external_id__in=[c["trajectory_id"] for c in choices])}
    assert len(stored) == len(PROMPTS) and {t.policy_version for t in stored.values()} == {1}
    score = _scorer(dense_dir)
    for c in choices:
        step = Step.objects.get(trajectory=stored[c["trajectory_id"]])
        assert step.logprobs == pytest.approx(c["logprobs"]["token_logprobs"])
        # Every sampled token's behaviour log-prob, in order, is the policy's.
        expected = score(step.extra["prompt_token_ids"], step.token_ids)
        assert torch.allclose(torch.tensor(step.logprobs), expected, atol=1e-4)


@pytest.mark.django_db(transaction=True)
def test_a_swap_under_concurrent_load_leaves_no_trajectory_naming_the_wrong_version(creds, dense_dir, tmp_path):
    _, v2 = _versions(creds.project, dense_dir, tmp_path)
    proc, url, internal = _serve(creds.project.slug, "vllm")
    answers: list[tuple[int, str, str]] = []
    swapped = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=300, headers=_key(creds)) as http:
            for j in range(8):
                r = http.post(url + "/v1/completions", json={
                    "model": "acme", "prompt": PROMPTS[(i + j) % len(PROMPTS)], "max_tokens": 16, "seed": 100 * i + j})
                answers.append((r.status_code, r.headers.get("flywheel-policy-version"), r.json()["id"]))
                if j == 2:
                    swapped.wait(300)  # every client is mid-stream when the swap lands

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: len(answers) >= 6, timeout=300, what="six answers")
        _promote(v2)
        swap = httpx.post(internal + "/internal/load", json={"version": 2}, timeout=300,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        swapped.set()
        for t in threads:
            t.join(600)
        assert swap.status_code == 200 and swap.json()["version"] == 2
        assert len(answers) == 48 and {a[0] for a in answers} == {200}
    finally:
        swapped.set()
        _stop(proc)
    named = {tid: int(version) for _, version, tid in answers}
    assert set(named.values()) == {1, 2}
    stored = Trajectory.objects.filter(external_id__in=named).prefetch_related("steps")
    assert stored.count() == 48
    score = {1: _scorer(dense_dir), 2: _scorer(tmp_path / "v2")}
    for t in stored:
        assert t.policy_version == named[t.external_id]
        step = t.steps.get()
        prompt, tokens = step.extra["prompt_token_ids"], step.token_ids
        recorded = torch.tensor(step.logprobs)
        # The behaviour log-probs are those of the version the trajectory names, not the other's.
        assert torch.allclose(recorded, score[t.policy_version](prompt, tokens), atol=1e-4)
        assert not torch.allclose(recorded, score[3 - t.policy_version](prompt, tokens), atol=1e-2)
