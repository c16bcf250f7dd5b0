"""Replay rollouts: prompts cut from the corpus's training lines, rewarded by the accepted
characters against what was actually written; the held-out files never used.

    .venv/bin/python -m pytest tests/training/runs/test_replay_rollouts.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import BadRequest
from tests.training.runs.test_midtrain import CODE
from training.corpora.selectors import corpus_texts
from training.corpora.services import corpus_add_paths, heldout_paths
from training.runs.replay import ReplayRollouts, replay_prompt_count, replay_reward
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import policy_folder

pytestmark = pytest.mark.django_db


def test_the_reward_is_the_share_of_the_real_rest_of_the_line_the_suggestion_got_right():
    rest = "sum(q * rate for q in self.quanta)"
    assert replay_reward(rest, rest) == 1.0
    assert replay_reward(rest + "\nnext line", rest) == 1.0  # only the first line is shown
    assert replay_reward("sum(q * r", rest) == pytest.approx(9 / len(rest))
    assert replay_reward("sum(x)", rest) == pytest.approx(4 / len(rest))
    assert replay_reward("su", rest) == 0.0  # fewer characters than a Tab is worth
    assert replay_reward("len(self)", rest) == 0.0
    assert replay_reward("", "") == 0.0


def test_the_share_splits_a_rounds_prompts_between_corpus_and_users():
    from training.corpora.config import ReplayConfig

    assert replay_prompt_count({"prompts": 32, "G": 4}, ReplayConfig(share=0.25)) == 8
    assert replay_prompt_count({"prompts": 3, "G": 4}, ReplayConfig(share=0.1)) == 1  # at least one when on
    assert replay_prompt_count({"prompts": 32, "G": 4}, None) == 0


@pytest.fixture
def marked_code(settings, tmp_path):
    """A code base whose held-out files say so in every line (HELDOUT_...)."""
    settings.FLYWHEEL_CORPUS_DIR = tmp_path / "store"
    root = tmp_path / "code"
    root.mkdir()
    names = [f"ledger_{i}.py" for i in range(30)]
    held = heldout_paths(names, 10)
    for i, name in enumerate(names):
        text = CODE.replace("{i}", str(i))
        (root / name).write_text(text.replace("quanta", "HELDOUT_quanta") if name in held else text)
    return root, held


def test_a_run_replays_only_training_lines_and_learns_without_a_single_click(creds, production, marked_code,
                                                                             client, bob):
    root, held = marked_code
    corpus = corpus_add_paths(creds.project, [str(root)])
    assert set(corpus.files.filter(heldout=True).values_list("path", flat=True)) == held
    settings = RunSettings.from_dict({"steps": 2, "batch_size": 8, "replay": {"share": 1.0},
                                      "group": {"prompts": 4, "G": 3, "max_tokens": 8, "rounds": 2}})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    replay = ReplayRollouts.setup(run, settings, policy_folder(production))
    try:
        assert replay.files and not set(replay.files) & held
        training_lines = {line.strip() for _, text in corpus_texts(corpus, heldout=False) for line in text.splitlines()}
        for r in range(20):
            for p in replay.prompts(r):
                assert "HELDOUT" not in p.prompt + p.rest and (p.prompt + p.rest) in training_lines
    finally:
        replay.close()
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    c = run.result
    assert c["replay_share"] == 1.0 and c["replay_prompts_per_round"] == 4 and c["replay_rollouts"] > 0
    assert len(c["replay_reward_by_round"]) == 2  # both rounds sampled from the corpus
    assert run.candidate is not None and run.steps.count() >= 2
    client.force_login(bob)
    page = client.get(f"/p/{creds.project.slug}/runs/").content.decode()
    assert "100% corpus" in page  # the runs page shows the share


def test_replay_needs_group_rollouts_and_a_corpus(creds, production, marked_code):
    from core.errors import NotFound

    with pytest.raises(BadRequest, match="need group rollouts"):
        RunSettings.from_dict({"replay": {"share": 0.5}})
    with pytest.raises(BadRequest, match="share must be in"):
        RunSettings.from_dict({"group": {"prompts": 4, "G": 2}, "replay": {"share": 2}})
    with pytest.raises(NotFound, match="has no"):
        training_run_start(creds.project, RunSettings.from_dict({"group": {"prompts": 4, "G": 2},
                                                                 "replay": {"share": 0.5}}), enqueue=False)
    assert RunSettings.from_dict(RunSettings.from_dict({"group": {"prompts": 4, "G": 2}, "replay": {"share": 0.5}})
                                 .to_dict()).replay == {"share": 0.5, "corpus": None, "min_prefix": 4}


def test_a_bf16_run_samples_its_rollouts_in_bf16_and_trains(creds, production, marked_code):
    """A bf16 run's candidate is served in bf16, so its rollouts sample from bf16 weights (the fused
    forward in bf16): the behaviour log-probs are those of the weights it serves."""
    root, _ = marked_code
    corpus_add_paths(creds.project, [str(root)])
    settings = RunSettings.from_dict({"steps": 2, "batch_size": 8, "replay": {"share": 1.0}, "precision": "bf16",
                                      "group": {"prompts": 4, "G": 3, "max_tokens": 8, "rounds": 2}})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    replay = ReplayRollouts.setup(run, settings, policy_folder(production))
    try:
        assert replay.engine.model.dtype == torch.bfloat16
        samples = replay.round(0)
        assert samples and all(math.isfinite(lp) for s in samples for lp in s.behaviour_logprobs)
    finally:
        replay.close()
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.result["precision"] == "bf16" and run.result["replay_rollouts"] > 0
