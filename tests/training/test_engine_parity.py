"""The trainer's recomputed log-probs equal the torch inference engine's, bit for bit.

Both run the model under kernels' batch_invariant_mode; sequences of one length are packed in
one batch (padding changes the attention reduction, so equal lengths are the promise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engine import SamplingParams, TorchEngine
from training.pretrain import PolicyConfig, build_policy, stdlib_corpus
from training.rl.config import RLConfig
from training.rl.trainer import Batch, Sample, compute_logprobs


@pytest.fixture(scope="module", params=["dense", "moe"])
def policy(request, tmp_path_factory) -> Path:
    return build_policy(tmp_path_factory.mktemp("parity") / request.param, PolicyConfig(kind=request.param),
                        stdlib_corpus(max_lines=5_000))


def _same_length_samples(engine: TorchEngine, n: int) -> list:
    prompt = engine.encode("def add(a, b):")
    params = SamplingParams(max_tokens=10, seed=5, ignore_eos=True)
    return engine.generate([prompt], n=n, sampling=params)


def test_trainer_and_torch_engine_logprobs_are_bitwise_equal(policy):
    engine = TorchEngine(policy, version=1)
    completions = _same_length_samples(engine, 6)
    assert len({len(c.token_ids) for c in completions}) == 1
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    samples = [Sample(prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids) for c in completions]
    batch = Batch.from_samples(samples, pad_id=0, advantages=torch.zeros(len(samples)))
    # Router replay off: the trainer must pick the same experts on its own, from the same bits.
    trainer_lp = compute_logprobs(model, batch, RLConfig(batch_invariant=True, router_replay=False))  # (B, T)
    for row, c in enumerate(completions):
        ours = trainer_lp[row][batch.completion_mask[row]]
        assert torch.equal(ours, torch.tensor(c.logprobs)), (ours - torch.tensor(c.logprobs)).abs().max()
