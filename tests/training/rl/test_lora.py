"""LoRA adapters (training/rl/lora.py): one step of ours equals PEFT's own reference, the adapter
is saved in PEFT's layout and loads back, the merged weights are the adapter model's, and the
adapter settings are validated with the fix.

    .venv/bin/python -m pytest tests/training/rl/test_lora.py -q -p no:django
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import Qwen2Config, Qwen2ForCausalLM

from core.errors import BadRequest
from training.rl.config import AdapterConfig, RLConfig
from training.rl.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    AdapterMismatch,
    adapter_of,
    lora_attach,
    lora_config,
    lora_save,
    merged_state_dict,
)
from training.rl.loss import LossInputs, policy_loss
from training.rl.trainer import Sample, prepare_batch, rl_step, token_entropy, token_logprobs
from training.runs.settings import RunSettings

VOCAB, PAD = 32, 0
LORA = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
# One AdamW step moves an adapter weight by about lr whatever its gradient's size (m / sqrt(v) is
# +-1 on the first step), so the two sides' float-rounding differences in the gradient show up in
# the step only where a gradient is ~0; the tolerance is on the weights after the step.
STEP_ATOL = 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7


def tiny_dense(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def group_samples(seed: int = 1) -> list[Sample]:
    """Two prompts x 3 completions (groups: the shared-prefix forward), half with a served mu."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in range(2):
        prompt = torch.randint(1, VOCAB, (5 + p,), generator=gen).tolist()
        for g in range(3):
            n = 3 + g
            completion = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
            mu = (-torch.rand(n, generator=gen) * 3).tolist() if g % 2 else None
            out.append(Sample(prompt, completion, reward=float(g), behaviour_logprobs=mu, policy_version=1,
                              group=f"p{p}"))
    return out


def _adapters(seed: int = 0) -> tuple[PeftModel, torch.nn.Module]:
    """PEFT's model and ours over the same base, with the same non-zero adapter (B = 0 at init
    would leave A without a gradient on the first step)."""
    reference = get_peft_model(tiny_dense(seed), lora_config(LORA))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ours = lora_attach(tiny_dense(seed), LORA)
    result = set_peft_model_state_dict(ours, _adapter(reference))
    assert not result.unexpected_keys
    return reference, ours


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors by module name (PeftModel's keys carry its wrapper's prefix)."""
    return {k.removeprefix(PEFT_PREFIX): v for k, v in get_peft_model_state_dict(model).items()}


def _reference_step(model: PeftModel, batch, cfg: RLConfig) -> None:  # noqa: ANN001
    """PEFT's plain path: the PeftModel's forward over every row whole, the same loss, AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    optimizer.zero_grad()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    logprobs = token_logprobs(logits, batch.input_ids)  # (B, T)
    old = logprobs.detach()
    out = policy_loss(LossInputs(logprobs=logprobs, old_logprobs=old, advantages=batch.advantages,
                                 mask=batch.completion_mask,
                                 behaviour_logprobs=torch.where(batch.behaviour_mask, batch.behaviour_logprobs, old),
                                 same_weights=batch.same_weights, entropy=token_entropy(logits),
                                 normalizer=float(batch.completion_mask.sum())),
                      cfg.eps, cfg.eps_high, cfg.is_cap, cfg.beta)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()


@pytest.mark.parametrize("micro_batch_size", [2, 8])
def test_one_lora_step_of_ours_equals_peft_s_reference(micro_batch_size):
    cfg = RLConfig(lr=1e-2, micro_batch_size=micro_batch_size, batch_invariant=False)
    reference, ours = _adapters()
    batch = prepare_batch(group_samples(), 1, cfg, PAD)
    before = {k: v.clone() for k, v in _adapter(ours).items()}
    _reference_step(reference, batch, cfg)
    optimizer = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, fused=True)
    rl_step(ours, None, batch, optimizer, cfg)

    theirs, mine = _adapter(reference), _adapter(ours)
    assert set(theirs) == set(mine) and len(mine) == 2 * 3 * 2  # A and B of 3 modules x 2 layers
    grads_ref = {n: p.grad for n, p in reference.base_model.model.named_parameters() if p.requires_grad}
    grads_ours = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads_ours[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    moved = 0.0
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=STEP_ATOL)
        moved = max(moved, float((mine[key] - before[key]).abs().max()))
    assert moved > 100 * STEP_ATOL  # the step did move the adapter: the equality is not of two no-ops
    # Only the adapter trained: the frozen base has no gradient.
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)


def test_the_adapter_is_saved_in_peft_s_layout_and_loads_back_in_peft(tmp_path: Path):
    reference, ours = _adapters()
    lora_save(ours, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["r"] == LORA.rank
    assert adapter_of(tmp_path / "adapter").same_adapter(LORA)
    loaded = PeftModel.from_pretrained(tiny_dense(), str(tmp_path / "adapter"))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
    again = lora_attach(tiny_dense(), LORA, tmp_path / "adapter")
    torch.testing.assert_close(again(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_the_merged_weights_compute_the_adapter_model_s_logits():
    _, ours = _adapters()
    plain = tiny_dense(7)
    plain.load_state_dict(merged_state_dict(ours), strict=True)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    torch.testing.assert_close(plain(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_an_adapter_of_other_shapes_is_not_continued(tmp_path: Path):
    _, ours = _adapters()
    lora_save(ours, tmp_path / "adapter")
    with pytest.raises(AdapterMismatch, match="rank 4.*the run asks for rank 16"):
        lora_attach(tiny_dense(), AdapterConfig(kind="lora", rank=16, target_modules=LORA.target_modules),
                    tmp_path / "adapter")


@pytest.mark.parametrize(("value", "message"), [
    ({"kind": "lora", "rank": 0}, "adapter.rank must be an integer in [1, 1024], got 0"),
    ({"kind": "lora", "alpha": -1}, "adapter.alpha must be a number > 0"),
    ({"kind": "lora", "dropout": 1.0}, "adapter.dropout must be a number in [0, 1)"),
    ({"kind": "lora", "target_modules": []}, "adapter.target_modules must be a non-empty list"),
    ({"kind": "lora", "target_modules": "q_proj"}, "adapter.target_modules must be a list of module names"),
    ({"kind": "qlora"}, 'adapter.kind must be "full" or "lora"'),
    ({"kind": "lora", "rnak": 4}, "unknown adapter keys: ['rnak']"),
    ("half", 'adapter must be "full", "lora" or an object'),
])
def test_a_refused_adapter_says_what_is_wrong_and_how_to_fix_it(value, message):
    with pytest.raises(BadRequest) as caught:
        RunSettings.from_dict({"adapter": value})
    assert message in str(caught.value)
    assert '"kind": "lora", "rank": 8' in caught.value.fix


def test_full_fine_tuning_stays_the_default_and_lora_round_trips():
    assert RunSettings().adapter == AdapterConfig(kind="full")
    assert RunSettings.from_dict({}).to_dict()["adapter"]["kind"] == "full"
    s = RunSettings.from_dict({"adapter": {"kind": "lora", "rank": 16, "target_modules": ["q_proj"]}})
    assert RunSettings.from_dict(s.to_dict()) == s and s.adapter.scale == 1.0
    assert RunSettings.from_dict({"adapter": "lora"}).adapter.target_modules == ("q_proj", "v_proj")


def test_the_rollout_engine_loaded_with_the_merged_weights_scores_as_the_adapter_model(tiny_policy_dir):
    """The failure LoRA users report is silent: the rollouts ran on the base. The torch engine
    handed `merged_state_dict` scores a completion as the adapter model does, not as the base."""
    from transformers import AutoModelForCausalLM

    from inference.engines import make_engine
    from training.rl.trainer import token_logprobs

    model = lora_attach(AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32), LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        ours = token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt):]  # (3,)
    engine = make_engine("torch", tiny_policy_dir, version=1)
    try:
        base = torch.tensor(engine.score_many([(prompt, completion)])[0][0])
        engine.load_weights(merged_state_dict(model), 2)
        served = torch.tensor(engine.score_many([(prompt, completion)])[0][0])
    finally:
        engine.close()
    torch.testing.assert_close(served, ours, rtol=1e-4, atol=1e-4)
    assert float((base - ours).abs().max()) > 1e-2  # the adapter does change the scores
