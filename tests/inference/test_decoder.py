"""The fused KV-cached forward a training run's rollouts sample with (inference/decoder.py): the
draws and log-probs of transformers' own forward, new weights seen without a rebuild, and
transformers' forward kept where it does not apply.

    .venv/bin/python -m pytest tests/inference/test_decoder.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.decoder import dense_decoder
from inference.engines import SamplingParams, TorchEngine
from tests.inference.conftest import hf_logprobs
from training.pretrain import perturbed_state_dict

PROMPTS = ["def add(a, b):", "x", "for i in range(10):\n    total", "# a longer comment, the widest prompt here"]


def _unfused(engine: TorchEngine) -> TorchEngine:
    engine._decoder = lambda: None  # transformers' forward for every step, as an exact engine samples
    return engine


def test_rollouts_draw_what_transformers_forward_draws_with_its_log_probs(dense_dir: Path) -> None:
    fused, plain = TorchEngine(dense_dir, exact=False), _unfused(TorchEngine(dense_dir, exact=False))
    calls: list[int] = []
    hook = fused.model.register_forward_hook(lambda *a: calls.append(1))
    for sp in (SamplingParams(max_tokens=12, seed=4), SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=5),
               SamplingParams(max_tokens=12, temperature=0)):
        ours = fused.generate(PROMPTS, n=3, sampling=sp)  # mixed lengths: left padding in the prefill
        theirs = plain.generate(PROMPTS, n=3, sampling=sp)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    hook.remove()
    assert calls == []  # no step went through transformers' modules
    for c in ours[:: 3]:  # and the record is the model's: a plain forward of the finished sequence
        ref = hf_logprobs(dense_dir, c.prompt_token_ids, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_weights_loaded_into_the_engine_reach_the_fused_matrices(dense_dir: Path) -> None:
    engine = TorchEngine(dense_dir, exact=False)
    sp = SamplingParams(max_tokens=10, seed=6)
    engine.generate(PROMPTS[:1], n=2, sampling=sp)
    decoder = engine._fused
    state = perturbed_state_dict(dense_dir, scale=0.5)
    engine.load_weights(state, version=2)
    [c, _] = engine.generate(PROMPTS[:1], n=2, sampling=sp)
    assert engine._fused is decoder  # the same fused tensors, updated in place
    ref = hf_logprobs(dense_dir, c.prompt_token_ids, c.token_ids, state_dict=state)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_parameters_replaced_outside_the_engine_are_fused_again(dense_dir: Path) -> None:
    engine = TorchEngine(dense_dir, exact=False)
    sp = SamplingParams(max_tokens=8, seed=7)
    engine.generate(PROMPTS[:2], n=1, sampling=sp)
    state = perturbed_state_dict(dense_dir, scale=0.5)
    engine.model.load_state_dict(state, strict=False, assign=True)  # new tensors, not in-place copies
    assert not engine._fused.current()
    for c in engine.generate(PROMPTS[:2], n=1, sampling=sp):
        ref = hf_logprobs(dense_dir, c.prompt_token_ids, c.token_ids, state_dict=state)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_a_mixture_of_experts_and_an_exact_engine_keep_transformers_forward(dense_dir: Path, moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    assert dense_decoder(moe) is None
    engine = TorchEngine(dense_dir)  # exact: sampled, then scored under batch-invariant mode
    calls: list[int] = []
    hook = engine.model.register_forward_hook(lambda *a: calls.append(1))
    engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
    hook.remove()
    assert len(calls) == 4 + 1 and engine._fused is None  # 4 sampling steps, 1 scoring forward


@pytest.mark.parametrize("n", [1, 4])
def test_a_sequence_samples_the_same_alone_and_in_a_batch(dense_dir: Path, n: int) -> None:
    engine = TorchEngine(dense_dir, exact=False)
    sp = SamplingParams(max_tokens=10, seed=9)
    batch = engine.generate(PROMPTS, n=n, sampling=sp)
    alone = engine.generate(PROMPTS[:1], n=n, sampling=sp)  # prompt 0: the same RNG streams
    assert [c.token_ids for c in alone] == [c.token_ids for c in batch[:n]]
    for a, b in zip(alone, batch[:n], strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def _bf16_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-probs of `tokens` from transformers' own forward of the bf16 model (its bf16 numerics:
    RMSNorm and softmax in float32, everything else bf16), the log-softmax in float32; (T,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_bf16_engine_samples_in_bf16_with_transformers_bf16_log_probs(dense_dir: Path) -> None:
    """A bf16 run's rollouts sample from the weights it serves (bf16): the fused forward keeps its
    cache in bf16 and its log-probs are those of transformers' bf16 forward of the sequence within
    bf16's rounding (measured: 0.004 at most here)."""
    engine = TorchEngine(dense_dir, exact=False, dtype=torch.bfloat16)
    completions = engine.generate(PROMPTS, n=2, sampling=SamplingParams(max_tokens=12, seed=3))
    assert engine._fused is not None and engine._fused.start(1, 4).keys.dtype == torch.bfloat16
    worst = 0.0
    for c in completions:
        assert c.token_ids and all(torch.isfinite(torch.tensor(c.logprobs)))
        ours = torch.tensor(c.logprobs)
        worst = max(worst, (ours - _bf16_logprobs(dense_dir, c.prompt_token_ids, c.token_ids)).abs().max().item())
    assert worst < 0.02, worst
