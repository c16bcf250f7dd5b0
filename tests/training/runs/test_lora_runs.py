"""LoRA on the real loop: an RL run and a mid-training run train an adapter over the frozen base
(real PEFT, real PostgreSQL, the tiny policy), the version is the adapter over a named base in
the checkpoint store, the next run goes on training it, the gate evaluates it as any version,
and the training config API refuses a bad adapter with the fix.

    .venv/bin/python -m pytest tests/training/runs/test_lora_runs.py -q
"""

from __future__ import annotations

import pytest
import torch
from django.urls import reverse
from safetensors.torch import load_file

from feedback.models import Trajectory
from feedback.services import api_key_create, service_account_get
from tests.factories import member
from tests.training.runs.test_midtrain import _row_loss, _tokenizer, code_base  # noqa: F401 - the fixture
from tests.training.test_services import ingest_live, later, plain_spec
from training.corpora.services import corpus_add_paths
from training.gate.services import gate_run
from training.models import EvalSuite, PolicyVersion, TrainingStep
from training.promotion.services import gate_policy_update
from training.rewards.checks import Check, CheckResult, register_check
from training.rewards.services import rewards_compute_pending
from training.runs.midtrain import corpus_rows
from training.runs.services import midtrain_start, train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import checkpoint_store, policy_adapter_folder, policy_folder

pytestmark = pytest.mark.django_db

LORA = {"kind": "lora", "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@register_check("lora_test_length")
class Length(Check):
    """A completion's length, capped: something for the gate's suite to score."""

    def run(self, completion, context=None) -> CheckResult:
        return CheckResult(min(len(completion), 20) / 20, "length")


def _lora_run(project, tokenizer, adapter=LORA, n: int = 8):
    """A run of 3 steps on the project's first `n` live trajectories (ingested and rewarded once;
    every run of a test trains on them, pinned)."""
    if not Trajectory.objects.filter(project=project).exists():
        plain_spec(project, settle_seconds=0)
        ingest_live(project, tokenizer, n)
        rewards_compute_pending(project, now=later(1))
    ids = list(Trajectory.objects.filter(project=project).values_list("pk", flat=True))
    settings = RunSettings.from_dict({"steps": 3, "batch_size": 4, "rl": {"lr": 1e-2}, "adapter": adapter,
                                      "trajectory_ids": ids})
    run, _ = training_run_start(project, settings, enqueue=False)
    return train_policy(run.pk)


def _weights(version: PolicyVersion) -> dict[str, torch.Tensor]:
    return load_file(policy_folder(version) / "model.safetensors")


def test_a_lora_run_trains_only_an_adapter_and_its_version_is_that_adapter_over_production(
    creds, production, tokenizer
):
    run = _lora_run(creds.project, tokenizer)
    assert run.state == "succeeded", run.error
    assert TrainingStep.objects.filter(run=run).count() == 3
    candidate = run.candidate
    assert (candidate.parent, candidate.adapter_base) == (production, production)
    store = checkpoint_store()
    manifest = store.manifest(candidate.manifest_hash)
    assert manifest["kind"] == "adapter" and manifest["base"] == production.manifest_hash
    adapter = policy_adapter_folder(candidate)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    # The delta is the adapter: its bytes over the base's, the ratio the registry shows.
    base_bytes = store.manifest(production.manifest_hash)["raw_bytes"]
    assert candidate.delta_ratio == pytest.approx(manifest["blob_bytes"] / base_bytes)
    assert candidate.delta_ratio < 0.1, candidate.delta_ratio
    # Served merged: the adapter's layers moved, every other weight is the base's bit for bit.
    new, old = _weights(candidate), _weights(production)
    assert set(new) == set(old)
    moved = {k for k in old if not torch.equal(new[k], old[k])}
    assert moved and all(".q_proj." in k or ".v_proj." in k for k in moved)
    assert store.verify(candidate.manifest_hash)["kind"] == "adapter"


def test_the_next_lora_run_goes_on_training_the_adapter_over_the_same_base(creds, production, tokenizer):
    first = _lora_run(creds.project, tokenizer).candidate
    second_run = _lora_run(creds.project, tokenizer)
    assert second_run.state == "succeeded", second_run.error
    second = second_run.candidate
    assert (second.parent, second.adapter_base) == (first, production)  # one stored base for the lineage
    assert checkpoint_store().manifest(second.manifest_hash)["base"] == production.manifest_hash
    new, old = _weights(second), _weights(first)
    assert any(not torch.equal(new[k], old[k]) for k in old)


def test_a_run_asking_for_another_adapter_shape_over_an_adapter_fails_with_the_fix(creds, production, tokenizer):
    _lora_run(creds.project, tokenizer)
    run = _lora_run(creds.project, tokenizer, adapter={**LORA, "rank": 8})
    assert run.state == "failed" and "rank 4" in run.error and "train \"full\"" in run.error


def test_a_full_run_from_an_adapter_version_trains_every_weight_of_the_merged_policy(creds, production, tokenizer):
    lora = _lora_run(creds.project, tokenizer).candidate
    run = _lora_run(creds.project, tokenizer, adapter="full")
    assert run.state == "succeeded", run.error
    full = run.candidate
    assert full.parent == lora and full.adapter_base is None
    assert checkpoint_store().manifest(full.manifest_hash)["kind"] == "full"  # never a delta against an adapter
    new, old = _weights(full), _weights(lora)
    assert any(not torch.equal(new[k], old[k]) for k in old if "embed_tokens" in k or "mlp" in k)


def test_the_gate_evaluates_a_lora_version_on_its_merged_weights(creds, production, tokenizer, alice):
    EvalSuite.objects.create(project=creds.project, version=1,
                             prompts=[{"id": f"p{i}", "prompt": p} for i, p in
                                      enumerate(["def add(a, b):", "import os", "class Node:", "for i in range("])],
                             checks=[{"name": "lora_test_length", "weight": 1.0}], judge={}, aspects=[],
                             n_samples=2, max_tokens=8)
    gate_policy_update(creds.project, alice, "tiny policy", thresholds={
        "margin": -10.0, "kl_budget": 1e6, "aspect_tolerance": 10.0, "length_ratio_max": 100.0,
        "repeated_ngram_jump_max": 10.0, "min_median_chars": None})
    candidate = _lora_run(creds.project, tokenizer).candidate
    report = gate_run(candidate.id, actor="alice")
    rows = {r["name"]: r for r in report.checks}
    # A positive KL to production: the gate sampled the adapter's weights, not the base's.
    assert rows["kl"]["value"] > 0, rows["kl"]
    candidate.refresh_from_db()
    assert candidate.state in ("awaiting_approval", "rejected")
    assert report.passed == (candidate.state == "awaiting_approval")


def test_a_lora_midtrain_run_lowers_the_loss_with_an_adapter_only(creds, production, code_base):  # noqa: F811
    corpus = corpus_add_paths(creds.project, [str(code_base)])
    every_linear = {"kind": "lora", "rank": 8, "alpha": 16,
                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    run, _ = midtrain_start(creds.project, steps=40, batch_size=4, seq_len=64, lr=3e-2, warmup=0, enqueue=False,
                            adapter=every_linear)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert TrainingStep.objects.filter(run=run).count() == 40
    candidate = run.candidate
    # Measured on the same 128 rows of the code base, served merged, not on the steps' own batches
    # (each step sees other rows, so their losses differ by more than 40 adapter steps move them).
    # Slower than full fine-tuning on this 32-wide policy: a new code base's names live in the
    # embeddings, which the adapter leaves.
    rows = corpus_rows(run, type("C", (), {"corpus": corpus.pk, "seq_len": 64})(), _tokenizer(production), 128)
    before, after = _row_loss(policy_folder(production), rows), _row_loss(policy_folder(candidate), rows)
    assert after < before - 0.04, (before, after)
    assert candidate.adapter_base == production and candidate.config["adapter"]["rank"] == 8
    assert checkpoint_store().manifest(candidate.manifest_hash)["kind"] == "adapter"


# ------------------------------------------------------------------------------ the config API


@pytest.fixture
def admin_key(creds):
    return api_key_create(creds.project, ["admin"], name="ops",
                          owner=member(service_account_get("ops"), creds.project, "admin"))


def _put(client, body, key):
    return client.put("/api/v1/training-config", body, content_type="application/json",
                      HTTP_AUTHORIZATION=f"Bearer {key}")


def test_the_config_api_stores_a_lora_adapter_for_the_project_s_runs(client, creds, production, admin_key):
    answer = _put(client, {"min_new": 8, "steps": 2, "adapter": LORA}, admin_key)
    assert answer.status_code == 200, answer.json()
    assert answer.json()["config"]["adapter"] == {**LORA, "alpha": 8, "dropout": 0.0}
    read = client.get("/api/v1/training-config", HTTP_AUTHORIZATION=f"Bearer {admin_key}").json()["config"]
    assert read["min_new"] == 8 and read["adapter"]["kind"] == "lora" and read["adapter"]["rank"] == 4


def test_target_modules_naming_no_module_of_the_policy_are_a_400_listing_the_modules(
    client, creds, production, admin_key
):
    answer = _put(client, {"adapter": {"kind": "lora", "target_modules": ["q_proj", "query_key_value"]}}, admin_key)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "['query_key_value'] name no module" in error["message"]
    assert "'q_proj', 'up_proj', 'v_proj'" in error["message"]  # the modules it has
    assert error["fix"].startswith('Give "full", or {"kind": "lora"')


def test_a_bad_adapter_is_a_400_with_every_problem_and_a_reader_key_is_refused(client, creds, production, admin_key):
    answer = _put(client, {"steps": 0, "adapter": {"kind": "lora", "rank": 0, "dropout": 2}}, admin_key)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "steps must be >= 1" in message and "adapter.rank" in message and "adapter.dropout" in message
    reader = api_key_create(creds.project, ["read"], name="reader")
    assert _put(client, {"adapter": LORA}, reader).status_code == 403


def test_the_registry_shows_an_adapter_version_s_ratio_to_its_base(client, creds, production, tokenizer, alice):
    candidate = _lora_run(creds.project, tokenizer).candidate
    client.force_login(alice)
    page = client.get(reverse("registry", args=[creds.project.slug])).content.decode()
    assert f'data-adapter="{candidate.number}"' in page
    assert f"adapter/base {candidate.delta_ratio:.4f}" in page


def test_group_rollout_rounds_sample_the_adapter_the_run_reached(creds, production, tokenizer):
    """Rounds 1.. sample the weights the run reached: with LoRA, the base plus the adapter so far
    (merged for the rollout engine). A rollout engine left on the base would measure a KL of 0
    to production before each later round."""
    from tests.training.runs.test_group_rollouts import _ingest_clicks, _spec
    from training.rewards.reward_model import MIN_LABELS

    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, MIN_LABELS)
    rewards_compute_pending(creds.project, now=later(1))
    EvalSuite.objects.create(project=creds.project, version=1, max_tokens=8, n_samples=2,
                             prompts=[{"id": f"p{i}", "prompt": p} for i, p in enumerate(["import os", "x = [", "def f("])])
    settings = RunSettings.from_dict({
        "steps": 1, "batch_size": 16, "epochs": 1, "adapter": {**LORA, "alpha": 32},
        "rl": {"lr": 2e-2, "kl_to": "production", "kl_stop": 1e6, "length_stop": 100.0},
        "group": {"prompts": 4, "G": 4, "max_tokens": 6, "rounds": 3}})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.result["rollout_rounds"] == 3 and set(run.result["kl_by_round"]) == {"1", "2"}
    assert all(k > 1e-3 for k in run.result["kl_by_round"].values()), run.result["kl_by_round"]
    assert run.candidate.adapter_base == production


def test_a_lora_run_on_two_processes_goes_on_training_the_adapter_over_its_stored_base(
    creds, production, tokenizer, settings
):
    first = _lora_run(creds.project, tokenizer).candidate  # one process: an adapter version over production
    settings.FLYWHEEL_TRAIN_NPROC, settings.FLYWHEEL_TRAIN_COLLECTIVE_TIMEOUT_S = 2, 120
    run = _lora_run(creds.project, tokenizer)  # under torchrun, FSDP2: the adapter sharded with its base
    assert run.state == "succeeded", run.error
    assert TrainingStep.objects.filter(run=run).count() == 3
    second = run.candidate
    assert (second.parent, second.adapter_base) == (first, production)
    tensors = load_file(policy_adapter_folder(second) / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    # the ranks trained the adapter over production's weights (the stored base, not v2's merged
    # folder): every weight off the adapter's layers is production's bit for bit
    new, old = _weights(second), _weights(production)
    moved = {k for k in old if not torch.equal(new[k], old[k])}
    assert moved and all(".q_proj." in k or ".v_proj." in k for k in moved)
    assert any(not torch.equal(new[k], _weights(first)[k]) for k in moved)


@pytest.mark.django_db(transaction=True)  # the agent closes stale connections, as serve_policy does
def test_a_replica_is_pushed_no_adapter_bytes_and_serves_the_merged_adapter_version(creds, production, tokenizer,
                                                                                  tmp_path):
    """Its stored blob is the adapter; the replica holds and serves merged weights: the push
    carries no delta to or from it, and the replica merges the version from its store."""
    from django.utils import timezone

    from tests.training.replicas.test_replicas import _agent, _make_production
    from training.models import ServingReplica
    from training.replicas import push
    from training.replicas.services import PushPlanner
    from training.versions.selectors import serving_target

    candidate = _lora_run(creds.project, tokenizer).candidate
    agent = _agent(creds.project, production, tmp_path)
    _make_production(candidate)
    now = timezone.now()
    row = ServingReplica.objects.create(project=creds.project, address="http://10.0.0.3:8002", version=1,
                                        registered_at=now, heartbeat_at=now)
    (body,) = PushPlanner(serving_target(creds.project.id), [row]).bodies(row)
    header, blobs, files = push.push_decode(body)
    assert (header["role"], header["version"], blobs, files) == ("production", candidate.number, [], {})
    assert "manifest" not in header  # the catch-up path: the replica loads it from the store
    assert agent.receive(body)["version"] == candidate.number
    served = agent.server.engine.model.state_dict()
    merged = _weights(candidate)
    assert all(torch.equal(served[k], merged[k]) for k in merged if k in served)
    agent.server.close()


def test_train_now_trains_an_adapter_and_refuses_a_bad_one_with_the_fix(creds, production, tokenizer):
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    with pytest.raises(CommandError, match="adapter.rank must be an integer"):
        call_command("train_now", "--project", creds.project.slug, "--adapter", '{"kind": "lora", "rank": 0}')
    out = StringIO()
    call_command("train_now", "--project", creds.project.slug, "--steps", "1", "--batch-size", "4",
                 "--adapter", "lora", stdout=out)
    assert "succeeded: candidate v2" in out.getvalue()
    assert PolicyVersion.objects.get(project=creds.project, number=2).adapter_base == production


def test_a_number_json_reads_as_infinite_is_a_400_not_a_500(client, creds, production, admin_key):
    answer = client.put("/api/v1/training-config", '{"steps": 1e400, "adapter": {"kind": "lora", "alpha": 1e400}}',
                        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "steps must be a number, got inf" in message and "adapter.alpha must be a number > 0, got inf" in message
