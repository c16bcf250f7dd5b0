"""bf16 runs on the real loop (real PostgreSQL, the tiny policy): the candidate is stored in bf16,
the next bf16 version is a small delta against it, the run says what precision it trained in, and
the training config API takes `precision` or refuses it with the fix.

    .venv/bin/python -m pytest tests/training/runs/test_precision_runs.py -q
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from feedback.models import Trajectory
from feedback.services import api_key_create, service_account_get
from tests.factories import member
from tests.training.test_services import ingest_live, later, plain_spec
from training.rewards.services import rewards_compute_pending
from training.rl.precision import resolve_precision
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import checkpoint_store, policy_folder

pytestmark = pytest.mark.django_db


def _run(project, tokenizer, precision: str):
    if not Trajectory.objects.filter(project=project).exists():
        plain_spec(project, settle_seconds=0)
        ingest_live(project, tokenizer, 8)
        rewards_compute_pending(project, now=later(1))
    ids = list(Trajectory.objects.filter(project=project).values_list("pk", flat=True))
    settings = RunSettings.from_dict({"steps": 3, "batch_size": 4, "rl": {"lr": 1e-5}, "precision": precision,
                                      "trajectory_ids": ids})
    run, _ = training_run_start(project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    return run


def test_a_bf16_run_stores_bf16_weights_and_the_next_bf16_version_is_a_small_delta(creds, production, tokenizer):
    first = _run(creds.project, tokenizer, "bf16")
    assert first.result["precision"] == "bf16"
    weights = load_file(policy_folder(first.candidate) / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    second = _run(creds.project, tokenizer, "bf16")
    assert second.candidate.parent == first.candidate
    store = checkpoint_store()
    manifest = store.manifest(second.candidate.manifest_hash)
    assert manifest["kind"] == "delta"
    assert manifest["raw_bytes"] * 2 == store.manifest(production.manifest_hash)["raw_bytes"]
    # v1 -> first: float32 to bf16, every tensor stored whole; first -> second: the few bf16
    # values three steps at lr 1e-5 moved.
    assert second.candidate.delta_bytes * 2 < first.candidate.delta_bytes
    assert second.candidate.delta_ratio < 0.25, second.candidate.delta_ratio


def test_an_auto_run_records_what_auto_picked_on_this_worker(creds, production, tokenizer):
    run = _run(creds.project, tokenizer, "auto")
    assert run.result["precision"] == resolve_precision("auto")
    assert run.settings["precision"] == "auto"


@pytest.fixture
def admin_key(creds):
    return api_key_create(creds.project, ["admin"], name="ops",
                          owner=member(service_account_get("ops"), creds.project, "admin"))


def _put(client, body, key):
    return client.put("/api/v1/training-config", body, content_type="application/json",
                      HTTP_AUTHORIZATION=f"Bearer {key}")


def test_the_config_api_takes_a_precision_and_refuses_an_unknown_one_with_the_fix(client, creds, production,
                                                                                  admin_key):
    answer = _put(client, {"precision": "auto"}, admin_key)
    assert answer.status_code == 200, answer.json()
    assert answer.json()["config"]["precision"] == "auto"
    refused = _put(client, {"precision": "fp16", "steps": 0}, admin_key)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "precision must be one of ['fp32', 'bf16', 'auto'], got 'fp16'" in error["message"]
    assert "steps must be >= 1" in error["message"]
    assert '"bf16" (fp32 master weights, bf16 compute' in error["fix"]
