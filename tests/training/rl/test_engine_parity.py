"""The trainer's recomputed log-probs equal the torch inference engine's, bit for bit.

Both run the model under kernels' batch_invariant_mode; sequences of one length are packed in
one batch (padding changes the attention reduction, so equal lengths are the promise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engines import SamplingParams, TorchEngine
from training.pretrain import PolicyConfig, build_policy, stdlib_corpus
from training.rl.config import RLConfig
from training.rl.trainer import Batch, Sample, chunked_logprobs, compute_logprobs, pi_old


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


def test_a_run_reuses_its_own_rollouts_logprobs_as_pi_old_and_recomputes_the_rest(policy):
    """The job's pi_old: rows its engine sampled from the weights it starts from keep the engine's
    log-probs (no second forward); a row served by another version is recomputed."""
    engine = TorchEngine(policy, version=1, exact=False)  # as a run's rollouts sample
    prompts = [engine.encode(p) for p in ("def add(a, b):", "x = (", "for i in range(10):\n    total")]
    sp = SamplingParams(max_tokens=10, seed=7)
    ours = engine.generate(prompts, n=3, sampling=sp)
    exact = TorchEngine(policy, version=1).generate(prompts, n=3, sampling=sp)
    assert [c.token_ids for c in ours] == [c.token_ids for c in exact]  # the same draws, unscored
    assert len({len(c.prompt_token_ids) + len(c.token_ids) for c in ours}) > 1  # mixed lengths: padding
    served = Sample(prompt_ids=prompts[0], completion_ids=ours[0].token_ids,
                    behaviour_logprobs=[lp - 0.5 for lp in ours[0].logprobs])  # another version's mu
    samples = [Sample(prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids, behaviour_logprobs=c.logprobs)
               for c in ours] + [served]
    batch = Batch.from_samples(samples, pad_id=0, advantages=torch.zeros(len(samples)))
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    cfg = RLConfig(batch_invariant=True)
    old = pi_old(model, batch, [True] * len(ours) + [False], cfg)
    full = chunked_logprobs(model, batch, cfg)
    mask = batch.completion_mask
    assert torch.equal(old[-1][mask[-1]], full[-1][mask[-1]])  # recomputed, not the served mu
    for row, c in enumerate(ours):
        assert torch.equal(old[row][mask[row]], torch.tensor(c.logprobs))  # the engine's, as sampled
        assert torch.allclose(old[row][mask[row]], full[row][mask[row]], atol=1e-5, rtol=0)
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(exact[row].logprobs), atol=1e-5, rtol=0)
