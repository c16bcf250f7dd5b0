"""bf16 training (training/rl/precision.py): what "auto" picks on this hardware, bf16 autocast
numerics within stated tolerances of fp32 on a tiny policy, float32 masters that keep an update
smaller than a bf16 ulp, the serving dtype's smaller delta, and adapters saved in bf16.

    .venv/bin/python -m pytest tests/training/rl/test_precision.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kernels import delta
from tests.training.rl.test_lora import group_samples, tiny_dense
from training.rl.config import AdapterConfig, RLConfig
from training.rl.lora import ADAPTER_WEIGHTS, lora_attach, lora_save
from training.rl.precision import bf16_native, compute_context, resolve_precision, serving_state_dict
from training.rl.trainer import prepare_batch, rl_step, token_logprobs
from training.runs.updates import save_candidate

NATIVE = bf16_native()
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="this CPU has neither AVX-512 BF16 nor AMX: bf16 runs emulated, "
                                "the numerics below are checked on hardware that computes it")
# bf16 keeps 8 significant bits: a logit of magnitude ~4 is off by up to ~0.016, a log-prob (a
# difference of such numbers through a float32 log-softmax) by a few hundredths. Measured on this
# tiny policy: max |dlogp| 0.02-0.03, gradient cosine > 0.999.
LOGPROB_ATOL = 0.08
GRAD_COSINE_MIN = 0.99
LOSS_ATOL = 0.02


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo on this system: the CPU's flags cannot be read")
    return {f for line in info.read_text().splitlines() if line.startswith("flags") for f in line.split()}


def test_auto_picks_bf16_exactly_where_the_cpu_computes_bf16_natively():
    native = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert bf16_native() is native
    assert resolve_precision("auto") == ("bf16" if native else "fp32")
    assert (resolve_precision("fp32"), resolve_precision("bf16"), resolve_precision(None)) == ("fp32", "bf16", "fp32")
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'auto'\], got 'fp16'"):
        resolve_precision("fp16")


def _loss_and_grads(precision: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model = tiny_dense()
    batch = prepare_batch(group_samples(), 1, RLConfig(), 0)
    with compute_context(precision):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
        logp = token_logprobs(logits, batch.input_ids)  # (B, T) float32
        mask = batch.completion_mask.float()
        loss = -(logp * batch.advantages[:, None] * mask).sum() / mask.sum()
    loss.backward()
    return logp.detach() * mask, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@needs_bf16
def test_bf16_log_probs_loss_and_gradient_are_within_tolerance_of_fp32():
    logp32, loss32, grads32 = _loss_and_grads("fp32")
    logp16, loss16, grads16 = _loss_and_grads("bf16")
    assert (logp16 - logp32).abs().max() <= LOGPROB_ATOL
    assert (logp16 - logp32).abs().max() > 0  # it did compute in bf16
    assert abs(float(loss16 - loss32)) <= LOSS_ATOL
    flat32 = torch.cat([g.flatten() for g in grads32.values()])
    flat16 = torch.cat([grads16[n].flatten() for n in grads32])
    assert flat16.dtype == torch.float32  # the masters' gradients: float32 weights, float32 grads
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) >= GRAD_COSINE_MIN


@needs_bf16
def test_a_bf16_step_keeps_float32_masters_that_hold_an_update_below_a_bf16_ulp():
    model = tiny_dense()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = prepare_batch(group_samples(), 1, RLConfig(lr=1e-6), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    with compute_context("bf16"):
        rl_step(model, None, batch, opt, RLConfig(lr=1e-6))
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters())
    served_moved = sum(int((serving_state_dict({n: p}, "bf16")[n] != before[n].to(torch.bfloat16)).sum())
                       for n, p in model.named_parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert moved > 10 * served_moved  # the masters moved; most bf16 values did not


def test_a_small_update_s_delta_is_smaller_in_bf16_than_in_fp32():
    model = tiny_dense()
    parent = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    batch = prepare_batch(group_samples(), 1, RLConfig(lr=1e-5), 0)
    with compute_context("bf16"):
        rl_step(model, None, batch, opt, RLConfig(lr=1e-5))
    child = model.state_dict()
    fp32 = len(delta.encode(dict(child), parent))
    child16, parent16 = serving_state_dict(child, "bf16"), serving_state_dict(parent, "bf16")
    bf16 = len(delta.encode(child16, parent16))
    # AdamW's first step moves every weight by ~lr: every fp32 value changes, about a fifth of the
    # bf16 ones (measured 3.6x fewer bytes here; bench/delta.py's later steps change fewer still).
    assert bf16 * 3 < fp32, (bf16, fp32)
    changed32 = sum(int((child[k] != parent[k]).sum()) for k in child) / sum(t.numel() for t in child.values())
    changed16 = sum(int((child16[k] != parent16[k]).sum()) for k in child) / sum(t.numel() for t in child.values())
    assert changed32 > 0.9 and changed16 < 0.4, (changed32, changed16)
    decoded = delta.decode(delta.encode(child16, parent16), parent16)
    assert all(torch.equal(decoded[k], child16[k]) for k in child16)


def test_a_bf16_candidate_is_saved_in_bf16_and_names_it_while_the_masters_stay_float32(tmp_path, tiny_policy_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    save_candidate(model, tiny_policy_dir, tmp_path, "bf16")
    saved = load_file(tmp_path / "model.safetensors")
    assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
    assert AutoConfig.from_pretrained(str(tmp_path)).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters()) and model.config.dtype in (torch.float32, "float32")
    state = model.state_dict()
    assert all(torch.equal(saved[k], state[k].to(torch.bfloat16)) for k in saved)
    assert (tmp_path / "tokenizer.json").exists()


def test_a_bf16_run_s_adapter_is_saved_in_bf16(tmp_path):
    model = lora_attach(tiny_dense(), AdapterConfig(kind="lora", rank=4))
    lora_save(model, tmp_path / "fp32")
    lora_save(model, tmp_path / "bf16", "bf16")
    full, half = load_file(tmp_path / "fp32" / ADAPTER_WEIGHTS), load_file(tmp_path / "bf16" / ADAPTER_WEIGHTS)
    assert set(full) == set(half) and all(".lora_" in k for k in half)
    assert all(full[k].dtype == torch.float32 and half[k].dtype == torch.bfloat16 for k in half)
    assert all(torch.equal(full[k].to(torch.bfloat16), half[k]) for k in half)
