"""The trainer step: packing, staleness, log-probs, gradient sign, replay, and learning.

    .venv/bin/python -m pytest tests/training/rl/test_trainer.py -q -p no:django -s   # -s prints the learning numbers
"""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from kernels.routing import capture_routing, moe_routers
from training.rl.config import RLConfig
from training.rl.trainer import (
    Batch,
    NoFreshSamples,
    Sample,
    _gather_logprobs,
    compute_advantages,
    compute_logprobs,
    filter_stale,
    prepare_batch,
    rl_step,
    shared_prompts,
    token_logprobs,
)

VOCAB, PAD = 16, 0


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg)
    for router in moe_routers(model):
        torch.nn.init.normal_(router.weight, std=1.0)
    return model


# ------------------------------------------------------------------------------ packing, selection

def test_it_packs_prompt_and_completion_right_padded_with_a_completion_mask():
    samples = [
        Sample([5, 6], [7, 8, 9], reward=1.0, behaviour_logprobs=[-0.1, -0.2, -0.3]),
        Sample([5], [4], reward=0.0, routing=torch.ones(2, 1, 2, dtype=torch.long)),
    ]
    batch = Batch.from_samples(samples, pad_id=PAD, advantages=torch.tensor([0.5, -0.5]))
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    assert torch.allclose(batch.behaviour_logprobs[0], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    assert batch.behaviour_mask[1].sum() == 0  # unknown mu for the second sample
    assert batch.routing.shape == (2, 2, 5, 2)
    assert (batch.routing[0] == -1).all() and (batch.routing[1, :, 1:] == -1).all()
    assert [mb.size for mb in batch.micro_batches(1)] == [1, 1]


def test_filter_stale_drops_and_counts_samples_more_than_k_versions_behind():
    samples = [Sample([1], [2], policy_version=v) for v in (5, 3, 2, None)]
    kept, dropped = filter_stale(samples, current_version=5, max_staleness=2)
    assert [s.policy_version for s in kept] == [5, 3, None] and dropped == 1
    assert filter_stale([{"policy_version": 0}, {"policy_version": 9}], 9, 0) == ([{"policy_version": 9}], 1)


def test_prepare_batch_reports_dropped_and_refuses_an_all_stale_batch():
    cfg = RLConfig(max_staleness=1)
    samples = [Sample([1], [2], reward=1.0, policy_version=v, group="p") for v in (4, 4, 1)]
    batch = prepare_batch(samples, current_version=4, cfg=cfg, pad_id=PAD)
    assert batch.size == 2 and batch.dropped_stale == 1
    with pytest.raises(NoFreshSamples) as err:
        prepare_batch(samples[2:], current_version=4, cfg=cfg, pad_id=PAD)
    assert err.value.dropped == 1


def test_advantages_are_given_group_relative_or_against_the_running_baseline():
    cfg = RLConfig(baseline_decay=0.5)
    samples = [
        Sample([1], [2], reward=1.0, group="a"),
        Sample([1], [3], reward=0.0, group="a"),
        Sample([1], [2], reward=1.0, task="tab"),
        Sample([1], [2], reward=1.0, task="tab"),
        Sample([1], [2], reward=1.0, advantage=-3.0),
    ]
    assert compute_advantages(samples, cfg).tolist() == [0.5, -0.5, 1.0, 0.5, -3.0]


# ------------------------------------------------------------------------------ log-probs

@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_logprobs_matches_log_softmax_gather(chunk, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(dtype)
    ids = torch.randint(0, 11, (3, 5))
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(_gather_logprobs(logits, ids, chunk), want, atol=1e-5)


def test_token_logprobs_are_aligned_with_the_tokens_they_score():
    logits = torch.randn(2, 4, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 4))
    out = token_logprobs(logits, ids)  # (B, T)
    assert out.shape == (2, 4) and (out[:, 0] == 0).all()
    assert torch.allclose(out[1, 2], torch.log_softmax(logits[1, 1], -1)[ids[1, 2]])


# ------------------------------------------------------------------------------ the step

def completion_logprob(model, batch, cfg) -> torch.Tensor:
    lp = compute_logprobs(model, batch, cfg)  # (B, T)
    return (lp * batch.completion_mask).sum(-1)  # (B,)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_step_moves_the_completion_log_prob_in_the_direction_of_its_advantage(advantage):
    model = tiny_moe()
    cfg = RLConfig(lr=0.05, beta=0.0)
    batch = Batch.from_samples([Sample([3, 4], [5, 6, 7])], PAD, torch.tensor([advantage]))
    before = completion_logprob(model, batch, cfg)
    rl_step(model, None, batch, torch.optim.SGD(model.parameters(), lr=cfg.lr), cfg)
    after = completion_logprob(model, batch, cfg)
    assert (after - before).item() * advantage > 0


def test_micro_batching_gives_the_same_gradient_as_one_batch():
    samples = [Sample([1, 2], [3, 4, 5][: i + 1], reward=float(i), group="g") for i in range(3)]
    grads = []
    for micro in (1, 3):
        model = tiny_moe()
        cfg = RLConfig(micro_batch_size=micro, beta=0.1)
        batch = prepare_batch(samples, 0, cfg, PAD)
        rl_step(model, tiny_moe(seed=1), batch, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


class WholeLogits(torch.nn.Module):
    """The same model behind a forward without `logits_to_keep`: logits at every position."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_scoring_only_the_completion_positions_gives_the_whole_forwards_gradient_and_metrics():
    # Prompts of 3 to 5 tokens: the rows' completions start at different columns, none at 1.
    samples = [Sample([1, 2, 3, 1, 2][: i + 3], [4, 5, 6][: 3 - i], reward=float(i), group="g",
                      behaviour_logprobs=[-1.5] * (3 - i)) for i in range(3)]
    runs = []
    for wrap in (False, True):
        model = tiny_moe()
        cfg = RLConfig(micro_batch_size=3, beta=0.0)
        batch = prepare_batch(samples, 0, cfg, PAD)
        stepped = WholeLogits(model) if wrap else model
        metrics = rl_step(stepped, None, batch, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        runs.append((torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics))
    (tail_grad, tail), (whole_grad, whole) = runs
    assert torch.allclose(tail_grad, whole_grad, atol=1e-6)
    for key in ("loss", "entropy", "mismatch_kl", "clip_fraction", "is_truncated"):
        assert getattr(tail, key) == pytest.approx(getattr(whole, key), abs=1e-6), key


def tiny_dense(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("build", [tiny_moe, tiny_dense], ids=["moe", "dense"])
def test_forwarding_each_groups_prompt_once_gives_the_whole_forwards_gradient_and_metrics(build):
    # Three groups with prompts of 4, 6 and 3 tokens (rows shuffled across them), completions of
    # 1 to 4 tokens, and a row alone with its prompt: the prompts are forwarded once each.
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9, 10], "c": [11, 12, 3]}
    rows = [("a", [5, 6]), ("b", [1]), ("a", [7, 8, 9, 1]), ("c", [2, 2, 2]), ("b", [4, 4, 4]),
            ("a", [3]), ("c", [9, 8]), ("solo", [6, 7, 8])]
    prompts["solo"] = [13, 14, 15, 2, 1]
    samples = [Sample(prompts[g], c, reward=float(i % 3), group=g, behaviour_logprobs=[-1.0 - 0.1 * i] * len(c))
               for i, (g, c) in enumerate(rows)]
    runs = []
    for shared in (True, False):
        model = build()
        fed = []
        model.get_input_embeddings().register_forward_hook(lambda m, a, out, fed=fed: fed.append(int(a[0].numel())))
        cfg = RLConfig(micro_batch_size=8, beta=0.1, shared_prefix=shared)  # with the reference's KL
        batch = prepare_batch(samples, 0, cfg, PAD)
        metrics = rl_step(model, build(seed=1), batch, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        runs.append((grad, metrics, sum(fed)))
    (shared_grad, shared_m, shared_fed), (whole_grad, whole_m, whole_fed) = runs
    assert torch.allclose(shared_grad, whole_grad, atol=1e-5), (shared_grad - whole_grad).abs().max()
    for key in ("loss", "kl_ref", "entropy", "mismatch_kl", "clip_fraction", "is_truncated"):
        assert getattr(shared_m, key) == pytest.approx(getattr(whole_m, key), abs=1e-5), key
    assert shared_m.kl_ref > 0
    assert shared_m.tokens == whole_m.tokens == sum(len(c) for _, c in rows)
    # Whole: 8 rows x 9 columns. Shared: 4 distinct prompts less their last token (4 x 5 padded),
    # then 8 rows x (last prompt token + up to 4 completion tokens).
    assert (whole_fed, shared_fed) == (8 * 9, 4 * 5 + 8 * 5)


def test_a_step_puts_a_prompts_rows_in_one_micro_batch():
    # Rows of two prompts interleaved, micro-batches of 2: regrouped, each micro-batch is one
    # prompt's two rows (one prefix forward each), and the gradient is the whole forward's.
    samples = [Sample([1, 2, 3] if i % 2 else [4, 5, 6], [7, 8][: 1 + i % 2], reward=float(i), group=i % 2)
               for i in range(4)]
    runs = []
    for shared in (True, False):
        model, fed = tiny_dense(), []
        model.get_input_embeddings().register_forward_hook(lambda m, a, out, fed=fed: fed.append(tuple(a[0].shape)))
        cfg = RLConfig(micro_batch_size=2, shared_prefix=shared)
        rl_step(model, None, prepare_batch(samples, 0, cfg, PAD), torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        runs.append((torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), fed))
    (shared_grad, shared_fed), (whole_grad, whole_fed) = runs
    assert torch.allclose(shared_grad, whole_grad, atol=1e-5)
    assert whole_fed == [(2, 5), (2, 5)]
    assert shared_fed == [(1, 2), (2, 2), (1, 2), (2, 3)]  # per micro-batch: its prompt less one token, then its rows


def test_rows_that_share_no_prompt_or_a_one_token_prompt_are_forwarded_whole():
    model = tiny_dense()
    distinct = prepare_batch([Sample([1, 2], [3]), Sample([2, 1], [3])], 0, RLConfig(), PAD)
    short = prepare_batch([Sample([1], [3]), Sample([1], [4])], 0, RLConfig(), PAD)
    grouped = prepare_batch([Sample([1, 2], [3]), Sample([1, 2], [4, 5])], 0, RLConfig(), PAD)
    assert shared_prompts(model, distinct) is None and shared_prompts(model, short) is None
    shared = shared_prompts(model, grouped)
    assert shared.group.tolist() == [0, 0] and shared.firsts.tolist() == [0] and shared.n_prompt.tolist() == [2, 2]


def test_metrics_report_mismatch_kl_kl_ref_routing_and_staleness():
    model, ref = tiny_moe(), tiny_moe(seed=1)
    cfg = RLConfig(beta=0.1, is_cap=1.5, max_staleness=2)
    with capture_routing(ref) as cap:  # routing "recorded" by a different model: replay must show mismatch
        ref(input_ids=torch.tensor([[1, 2, 3, 4]]))
    samples = [
        Sample([1, 2], [3, 4], reward=1.0, behaviour_logprobs=[-5.0, -0.01], policy_version=3, routing=cap.routing()),
        Sample([1, 2], [3, 4], reward=0.0, policy_version=0),
    ]
    batch = prepare_batch(samples, current_version=3, cfg=cfg, pad_id=PAD)
    metrics = rl_step(model, ref, batch, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    assert metrics.dropped_stale == 1 and metrics.tokens == 2 and metrics.reward_mean == 1.0
    assert metrics.mismatch_kl > 0 and metrics.kl_ref > 0 and metrics.entropy > 0
    assert metrics.routing_mismatch > 0 and metrics.grad_norm > 0 and metrics.tokens_per_s > 0
    assert 0 <= metrics.is_truncated <= 1 and metrics.clip_fraction == 0.0  # pi_old = pi_theta on one step
    assert all(math.isfinite(v) for v in metrics.to_dict().values() if isinstance(v, float))


def test_a_step_reports_staleness_apart_from_engine_mismatch_and_a_finite_kl_on_stale_rows():
    model, ref = tiny_dense(), tiny_dense(seed=1)
    cfg = RLConfig(beta=0.5, micro_batch_size=1, shared_prefix=False)
    fresh = Sample([1, 2], [3, 4], reward=1.0, policy_version=3)  # mu recomputed = pi_old: no mismatch
    stale = Sample([1, 2], [5, 6], reward=0.0, behaviour_logprobs=[-30.0, -0.01], policy_version=2)
    batch = prepare_batch([fresh, stale], current_version=3, cfg=cfg, pad_id=PAD)
    assert batch.same_weights.tolist() == [True, False]
    metrics = rl_step(model, ref, batch, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-6)  # the base's own row, micro-batched alone
    assert 0 < metrics.staleness_kl <= 10 and math.isfinite(metrics.kl_ref) and math.isfinite(metrics.grad_norm)
    only_fresh = rl_step(model, ref, prepare_batch([fresh], 3, cfg, PAD), torch.optim.SGD(model.parameters(), lr=0), cfg)
    assert only_fresh.staleness_kl is None and only_fresh.mismatch_kl is not None


# ------------------------------------------------------------------------------ learning

PROMPTS = [[1, 2], [3, 4], [5, 6], [7, 8]]
GOOD = set(range(12, 16))  # the toy preference: completions made of tokens 12..15
COMPLETION_LEN = 6


@torch.no_grad()
def sample(model, prompts: list[list[int]], g: int, gen: torch.Generator, version: int = 0) -> list[Sample]:
    """G samples per prompt; behaviour log-probs and routing recorded as inference would."""
    ids = torch.tensor([p for p in prompts for _ in range(g)])  # (B, P)
    for _ in range(COMPLETION_LEN):
        logits = model(input_ids=ids).logits[:, -1].float()  # (B, V)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)  # (B, 1)
        ids = torch.cat([ids, nxt], dim=1)
    with capture_routing(model) as cap:
        logp = token_logprobs(model(input_ids=ids).logits, ids)  # (B, T)
    routing = cap.routing().reshape(len(moe_routers(model)), ids.shape[0], ids.shape[1], -1)  # (L, B, T, k)
    n_p = len(prompts[0])
    return [
        Sample(
            prompt_ids=row[:n_p].tolist(), completion_ids=row[n_p:].tolist(),
            reward=sum(t in GOOD for t in row[n_p:].tolist()) / COMPLETION_LEN,
            behaviour_logprobs=logp[i, n_p:].tolist(), group=i // g, policy_version=version,
            routing=routing[:, i],
        )
        for i, row in enumerate(ids)
    ]


def one_sided_welch_p(after: list[float], before: list[float]) -> float:
    """P(mean(after) > mean(before) by chance); normal approximation, fine at n = 256."""
    def mean_var(x):
        m = sum(x) / len(x)
        return m, sum((v - m) ** 2 for v in x) / (len(x) - 1)

    (ma, va), (mb, vb) = mean_var(after), mean_var(before)
    z = (ma - mb) / math.sqrt(va / len(after) + vb / len(before))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_mean_reward_rises_on_a_toy_preference():
    torch.manual_seed(0)
    model, ref = tiny_moe(seed=0), tiny_moe(seed=0)
    gen = torch.Generator().manual_seed(1234)
    cfg = RLConfig(lr=3e-3, beta=0.01, micro_batch_size=32, group_normalize_std=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = [s.reward for s in sample(model, PROMPTS, 64, gen)]
    for version in range(12):
        batch = prepare_batch(sample(model, PROMPTS, 16, gen, version), version, cfg, PAD)
        rl_step(model, ref, batch, optimizer, cfg)
    after = [s.reward for s in sample(model, PROMPTS, 64, gen)]
    p = one_sided_welch_p(after, before)
    print(f"\nlearning: mean reward {sum(before) / 256:.3f} -> {sum(after) / 256:.3f} after 12 updates, one-sided p={p:.2e}")
    assert p < 0.01


def test_rl_config_validates_and_round_trips_without_torch_types():
    cfg = RLConfig(eps=0.1, max_staleness=3)
    assert RLConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="is_cap"):
        RLConfig(is_cap=0.5)
    with pytest.raises(ValueError, match="unknown RLConfig keys"):
        RLConfig.from_dict({"learning_rate": 1.0})
