"""The reward model stands in for the users on group rollouts: it must learn a taste from clicks
(any taste readable from checks, shape and tokens), say how well on clicks it never saw, and turn a
probability into the spec's signal scale."""

from __future__ import annotations

import random

import pytest

from training.rewards.reward_model import (
    MIN_LABELS,
    Labelled,
    auc,
    expected_signal_reward,
    fit_reward_model,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _population(taste, n: int, seed: int, noise: float = 0.05) -> list[Labelled]:
    rng = random.Random(seed)
    words = ["x", "self.value", "foo(1)", "return", "None", "'text'", "[a, b]", "\n    pass", ")", "):\n"]
    out = []
    for _ in range(n):
        completion = "".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        compiles = 1.0 if rng.random() < 0.5 else 0.0
        liked = taste(completion, compiles)
        label = (rng.random() < 0.5) if rng.random() < noise else liked
        out.append(Labelled("value = ", completion, {"python_compiles": compiles}, [ord(c) for c in completion],
                            1.0 if label else 0.0))
    return out


@pytest.mark.parametrize("taste", [
    lambda text, compiles: compiles > 0,  # a verifiable check carries the taste
    lambda text, compiles: "\n" not in text,  # a shape: one line
    lambda text, compiles: "self" in text,  # what the suggestion says
], ids=["check", "shape", "content"])
def test_it_learns_a_taste_and_ranks_clicks_it_never_saw(taste):
    train = _population(taste, 600, seed=1)
    model = fit_reward_model(train, ["python_compiles"])
    assert model is not None
    assert model.calibration["heldout"] == 120
    assert model.calibration["heldout_auc"] > 0.85
    assert model.calibration["heldout_log_loss"] < model.calibration["base_rate_log_loss"]
    fresh = _population(taste, 300, seed=2, noise=0.0)
    p = model.predict(fresh)
    labels = __import__("torch").tensor([i.label for i in fresh])
    assert auc(p, labels) > 0.85


def test_no_model_without_enough_clicks_or_with_one_class():
    few = _population(lambda t, c: c > 0, MIN_LABELS - 1, seed=3)
    assert fit_reward_model(few, ["python_compiles"]) is None
    one_class = [Labelled("p", "c", {}, [1], 1.0) for _ in range(MIN_LABELS * 2)]
    assert fit_reward_model(one_class) is None


def test_auc_is_a_rank_statistic():
    torch = pytest.importorskip("torch")
    assert auc(torch.tensor([0.9, 0.8, 0.1]), torch.tensor([1.0, 1.0, 0.0])) == 1.0
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 0.0])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])) == 0.5
    assert auc(torch.tensor([0.5]), torch.tensor([1.0])) is None


def test_expected_signal_reward_is_on_the_spec_scale():
    rewards = {"accept": 0.75, "reject": -0.25, "silent": 0.0}
    assert expected_signal_reward(1.0, True, rewards) == 0.75
    assert expected_signal_reward(0.0, True, rewards) == -0.25
    assert expected_signal_reward(0.5, True, rewards) == pytest.approx(0.25)
    assert expected_signal_reward(0.9, False, rewards) == 0.0  # not shown: no click


# ------------------------------------------------------------------------ prompt and completion together

TINY = dict(vocab_size=384, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position=128)


@pytest.fixture(scope="module")
def intent_population(tmp_path_factory):
    """2,500 intent-taste clicks on stdlib code lines, read by a tiny policy pretrained on them
    (300 steps): right, partially right, wrong (another line's rest) and the policy's own samples."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.pretrain import PolicyConfig, build_policy, load_tokenizer, pretrain, stdlib_corpus
    from training.rewards.intent_clicks import code_cases, intent_clicks

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits (15 ms vs 0.35 ms a layer on 2 busy cores)
    try:
        lines = stdlib_corpus(8000)
        folder = build_policy(tmp_path_factory.mktemp("intent-policy"), PolicyConfig(**TINY), lines[:3000])
        pretrain(folder, lines, seconds=float("inf"), batch_size=16, seq_len=64, max_steps=300)
        tokenizer = load_tokenizer(folder)
        policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        clicks = intent_clicks(code_cases(lines, 2500, seed=0), policy, encode, tokenizer.decode, seed=0)
        yield policy, encode, clicks
    finally:
        torch.set_num_threads(threads)


def test_a_model_that_reads_the_prompt_tells_a_right_continuation_from_a_wrong_one(intent_population):
    from training.rewards.reward_model import fit_context_model

    policy, encode, clicks = intent_population
    fitted = clicks[:2000]
    assert 0.3 < sum(c.label > 0 for c in fitted) / len(fitted) < 0.7  # both classes, mostly real code
    assert any(0 < c.label < 1 for c in fitted)  # graded (partial) accepts among them
    context = fit_context_model(fitted, policy, encode)
    features = fit_reward_model(fitted)
    assert context.calibration["heldout"] == 400 and context.calibration["heldout_auc"] >= 0.75
    assert abs(features.calibration["heldout_auc"] - 0.5) < 0.1  # the suggestion alone: near chance
    fresh = clicks[2000:]
    labels = __import__("torch").tensor([c.label for c in fresh])
    assert auc(context.predict(fresh), labels) >= 0.75 > auc(features.predict(fresh), labels) + 0.1


def test_the_users_model_falls_back_to_features_while_clicks_are_few(intent_population):
    from training.rewards.reward_model import (
        CONTEXT_MIN_LABELS,
        ContextRewardModel,
        RewardModel,
        fit_users_model,
    )

    policy, encode, clicks = intent_population
    few = fit_users_model(clicks[:CONTEXT_MIN_LABELS - 1], policy=policy, encode=encode)
    assert isinstance(few, RewardModel) and few.summary()["kind"] == "features"
    many = fit_users_model(clicks[:2000], policy=policy, encode=encode)
    assert isinstance(many, ContextRewardModel)
    summary = many.summary()
    assert summary["kind"] == "context" and summary["heldout_auc"] > summary["features_heldout_auc"]
