"""A training run's group rollouts on serving replicas' idle capacity (training/replicas/background.py
on the run's side, inference/background.py on the replica's): a run's rounds sampled on a replica
from the weights the run pushed, with their behaviour log-probs; what a busy or down replica gives
back sampled by the run itself; the per-replica setting and the registry's background share.

Real parts: PostgreSQL, the checkpoint store, the torch engine, the replica's internal listener
as serve_policy builds it (uvicorn in a thread of this process).

    .venv/bin/python -m pytest tests/training/replicas/test_background_rollouts.py -q
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from inference import apis, background
from inference.background import BackgroundRollouts
from inference.engines import SamplingParams, make_engine
from inference.listeners import INTERNAL_URLS, listener_app
from inference.serving import PolicyServer
from inference.tokens import replica_token
from tests.processes import InThreadServer
from tests.training.runs.test_group_rollouts import _ingest_clicks, _spec
from training.models import ServingReplica
from training.replicas.agent import ReplicaAgent
from training.replicas.background import ReplicaSampler, replicas_taking_rollouts
from training.replicas.services import BackgroundBeat
from training.rewards.reward_model import MIN_LABELS
from training.rewards.services import rewards_compute_pending
from training.rl.config import RLConfig
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import policy_folder

MASTER = "background-master-token"
SAMPLING = SamplingParams(max_tokens=6, seed=11)


def _row(project, address: str, slots: int, age_s: float = 1.0) -> ServingReplica:
    now = timezone.now()
    return ServingReplica.objects.create(project=project, address=address, version=1, registered_at=now,
                                         heartbeat_at=now - timedelta(seconds=age_s), background_slots=slots)


@pytest.fixture
def replica(production, monkeypatch):
    """A replica taking background rollouts (K = 8), registered for the project."""
    worker = BackgroundRollouts(policy_folder(production), 8)
    worker.start()
    monkeypatch.setattr(background, "WORKER", worker)
    server = InThreadServer(listener_app(INTERNAL_URLS))
    monkeypatch.setattr(apis, "REPLICA_TOKEN", replica_token(MASTER, server.url))
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=MASTER):
        _row(production.project, server.url, 8)
        yield worker
    server.stop()
    worker.close()


def test_a_runs_rounds_are_sampled_on_the_replica_from_the_weights_the_run_reached(creds, production, tokenizer,
                                                                                   replica):
    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, MIN_LABELS)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    settings = RunSettings(steps=1, batch_size=16, epochs=1, rl=RLConfig(lr=1e-3),
                           group={"prompts": 4, "G": 4, "max_tokens": 6, "rounds": 2})
    # the replica's heartbeat, as its agent beats (the set-up above can outlast FLYWHEEL_REPLICA_STALE_S)
    ServingReplica.objects.filter(background_slots__gt=0).update(heartbeat_at=timezone.now())
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    result = run.result
    assert result["rollout_rounds"] == 2 and result["rollouts_given_back"] == 0
    assert result["rollouts_on_replicas"] == replica.rollouts == 2 * 4 * 4  # every row, on the replica
    assert 0 < result["rollouts"] <= replica.rollouts  # the non-empty ones are trained on
    assert replica.weights == f"run-{run.pk}-round-1"  # round 1: the weights the run reached, pushed
    # round 0's rows (the base weights) trained as on-policy: their log-probs are the trainer's
    assert result["fresh_mismatch_kl"] is None or result["fresh_mismatch_kl"] < 1e-6
    assert math.isfinite(result["rollout_reward_by_round"][1])


def test_on_the_same_weights_a_replica_samples_what_the_runs_own_engine_would(creds, production, replica):
    _row(creds.project, "http://127.0.0.0:9", 8)  # first by address: the first slice, and down
    local = make_engine("torch", policy_folder(production), version=1, exact=False)
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=MASTER):
        sampler = ReplicaSampler.setup(creds.project.pk, local)
        assert sampler is not None and len(sampler.replicas) == 2
        prompts = [local.encode(p) for p in ["def add(a, b):", "import os", "class A:", "x = [", "if ok"]]
        got = sampler.generate(prompts, 3, SAMPLING, weights="v1", state=local.model.state_dict(), version=1)
    own = local.generate(prompts, n=3, sampling=SAMPLING)
    # the live replica took prompts 3 and 4 (the second slice); the down one's came back
    assert sampler.on_replicas == replica.rollouts == 6 and sampler.given_back == 9
    assert [c.prompt_index for c in got] == [c.prompt_index for c in own]
    for mine, theirs in zip(got[9:], own[9:], strict=True):  # rows keep their index's RNG stream
        assert mine.token_ids == theirs.token_ids and mine.version == 1
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


def test_a_later_round_pushes_a_delta_and_a_replica_holding_other_weights_gets_them_whole(creds, production,
                                                                                          replica):
    from training.pretrain import perturbed_state_dict

    local = make_engine("torch", policy_folder(production), version=1, exact=False)
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=MASTER):
        sampler = ReplicaSampler.setup(creds.project.pk, local)
    prompts = [local.encode(p) for p in ["def add(a, b):", "import os"]]
    sampler.generate(prompts, 2, SAMPLING, weights="round-0", state=local.model.state_dict(), version=1)
    whole = sampler.calls[-1]["push_bytes"]
    # the next round: the run trained (a small change of every weight), in place, as a run's model is
    local.load_weights(perturbed_state_dict(policy_folder(production), scale=1e-4, seed=5), 1)
    got = sampler.generate(prompts, 2, SAMPLING, weights="round-1", state=local.model.state_dict(), version=1)
    assert replica.weights == "round-1" and sampler.given_back == 0
    assert 0 < sampler.calls[-1]["push_bytes"] < whole  # a kernels.delta blob against round 0, not the whole set
    own = local.generate(prompts, n=2, sampling=SAMPLING)  # the replica decoded round 1 bit for bit
    assert [c.token_ids for c in got] == [c.token_ids for c in own]
    # another sampler (another run) pushed its own weights meanwhile: the delta's parent is gone
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=MASTER):
        other = ReplicaSampler.setup(creds.project.pk, local)
    other.generate(prompts, 1, SAMPLING, weights="other-run", version=1,
                   state=perturbed_state_dict(policy_folder(production), scale=1e-2, seed=9))
    local.load_weights(perturbed_state_dict(policy_folder(production), scale=1e-4, seed=6), 1)
    sampler.generate(prompts, 2, SAMPLING, weights="round-2", state=local.model.state_dict(), version=1)
    assert replica.weights == "round-2" and sampler.given_back == 0 and not sampler.errors
    assert sampler.calls[-1]["push_bytes"] > whole  # the refused delta (409), then the whole set


def test_what_a_busy_or_down_replica_gives_back_the_run_samples_itself(creds, production, replica):
    _row(creds.project, "http://127.0.0.1:9", 4)  # registered, fresh, but nothing listens
    local = make_engine("torch", policy_folder(production), version=1, exact=False)
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=MASTER):
        sampler = ReplicaSampler.setup(creds.project.pk, local)
    assert sampler is not None
    sampler.deadline_s = 0.5
    prompts = [local.encode(p) for p in ["def f(", "import sys", "y = (", "for i in"]]
    with background.LIVE.request():  # users are being served the whole time
        got = sampler.generate(prompts, 2, SAMPLING, weights="v1", state=local.model.state_dict(), version=1)
    assert sampler.on_replicas == 0 and sampler.given_back == 8 and replica.rollouts == 0
    assert sorted({c.prompt_index for c in got}) == [0, 1, 2, 3] and len(got) == 8
    assert all(len(c.logprobs) == len(c.token_ids) for c in got)
    assert len(sampler.errors) == 1 and "127.0.0.1:9" in sampler.errors[0]


def test_only_live_replicas_with_background_rollouts_on_take_them(creds):
    _row(creds.project, "http://10.0.0.1:8002", 16)
    _row(creds.project, "http://10.0.0.2:8002", 0)  # the setting off
    _row(creds.project, "http://10.0.0.3:8002", 16, age_s=3600)  # down
    assert [r.address for r in replicas_taking_rollouts(creds.project.pk)] == ["http://10.0.0.1:8002"]
    with override_settings(FLYWHEEL_INTERNAL_TOKEN=""):  # no token to reach them: the run samples itself
        assert ReplicaSampler.setup(creds.project.pk, None) is None


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_reports_the_background_share_and_the_registry_shows_it(creds, production, client, bob,
                                                                             tmp_path):
    folder = policy_folder(production)
    server = PolicyServer(creds.project.slug, make_engine("torch", folder, version=1), None)
    agent = ReplicaAgent(creds.project, server, "http://10.0.0.9:8002", lambda n, role: folder, tmp_path)
    agent.background = lambda: BackgroundBeat(slots=12, share=0.375, rollouts=4096)
    agent.register()
    row = ServingReplica.objects.get(pk=agent.replica_id)
    assert (row.background_slots, row.background_share, row.background_rollouts) == (12, 0.375, 4096)
    agent.background = lambda: BackgroundBeat(slots=12, share=0.5, rollouts=5000)
    agent.beat()
    row.refresh_from_db()
    assert (row.background_share, row.background_rollouts) == (0.5, 5000)
    _row(creds.project, "http://10.0.0.10:8002", 0)
    client.force_login(bob)
    table = client.get(f"/p/{creds.project.slug}/registry/").content.decode()
    table = table[table.index('id="replicas"'):]
    assert "50% · 5000 (K=12)" in table and 'data-background-share="0.500"' in table
    assert ">off<" in table  # the replica without the setting


def test_serve_policy_refuses_a_negative_background_capacity(creds):
    with pytest.raises(CommandError, match="--background-rollouts"):
        call_command("serve_policy", "--project", creds.project.slug, "--background-rollouts", "-1")
