"""The torch reference engine: seeded, batch-independent log-probs, HF numerics, MoE routing.

    .venv/bin/python -m pytest tests/inference/test_torch_engine.py -q -p no:django
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.engines import SamplingParams, TorchEngine, make_engine
from tests.inference.conftest import TRICKY_TEXTS, hf_logprobs
from training.pretrain import load_tokenizer, perturbed_state_dict

PROMPTS = [
    "def add(a, b):",
    "import os",
    "class Config(object):",
    "x",
    "for i in range(10):\n    ",
    "    return self._value",
    "# a longer comment that makes this prompt the longest one in the batch",
    "if __name__ == '__main__':",
]


@pytest.fixture(scope="module")
def engine(policy_dir: Path) -> TorchEngine:
    return TorchEngine(policy_dir)


def test_one_seed_gives_the_same_tokens(engine: TorchEngine) -> None:
    sp = SamplingParams(max_tokens=16, seed=7)
    a = engine.generate(PROMPTS[:2], n=2, sampling=sp)
    b = engine.generate(PROMPTS[:2], n=2, sampling=sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    other = engine.generate(PROMPTS[:2], n=2, sampling=SamplingParams(max_tokens=16, seed=8))
    assert [c.token_ids for c in a] != [c.token_ids for c in other]


def test_a_sequence_is_the_same_alone_and_in_a_batch_of_8(engine: TorchEngine) -> None:
    sp = SamplingParams(max_tokens=16, seed=1)
    batch = engine.generate(PROMPTS, n=1, sampling=sp)
    for i in (0, 3, 6):
        [alone] = engine.generate(PROMPTS[i : i + 1], n=1, sampling=SamplingParams(max_tokens=16, seed=1))
        # The RNG stream is per (prompt index, sample), so only prompt 0 samples the same tokens
        # alone; every member's log-probs must equal a forward of that sequence alone.
        assert engine.score(batch[i].prompt_token_ids, batch[i].token_ids, sp)[0] == batch[i].logprobs
        if i == 0:
            assert alone.token_ids == batch[0].token_ids
            assert alone.logprobs == batch[0].logprobs  # bitwise


def test_logprobs_equal_hf_log_softmax(engine: TorchEngine, policy_dir: Path) -> None:
    for c in engine.generate(PROMPTS[:3], n=2, sampling=SamplingParams(max_tokens=12, seed=2)):
        ref = hf_logprobs(policy_dir, c.prompt_token_ids, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_logprobs_are_those_of_the_tempered_distribution(engine: TorchEngine, policy_dir: Path) -> None:
    [c] = engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=12, seed=2, temperature=0.7))
    ref = hf_logprobs(policy_dir, c.prompt_token_ids, c.token_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_it_tokenises_like_the_trained_tokenizer(engine: TorchEngine, policy_dir: Path) -> None:
    trained = load_tokenizer(policy_dir)
    for text in TRICKY_TEXTS:
        assert engine.encode(text) == trained.encode(text)
    [c] = engine.generate([TRICKY_TEXTS[0]], n=1, sampling=SamplingParams(max_tokens=2, seed=0))
    assert c.prompt_token_ids == trained.encode(TRICKY_TEXTS[0])


def test_moe_routing_covers_every_forwarded_position(engine: TorchEngine) -> None:
    [c] = engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=8, seed=3, ignore_eos=True))
    config = engine.model.config
    if not hasattr(config, "num_experts"):
        assert c.routing is None
        return
    routing = torch.tensor(c.routing)  # (P + T - 1, L, k)
    assert routing.shape == (len(c.prompt_token_ids) + 7, config.num_hidden_layers, 2)
    assert 0 <= routing.min() and routing.max() < config.num_experts
    assert (routing[..., 0] != routing[..., 1]).all()


def test_max_tokens_and_stop_tokens_set_the_finish_reason(engine: TorchEngine) -> None:
    [long] = engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=5, seed=4, ignore_eos=True))
    assert (len(long.token_ids), long.finish_reason) == (5, "length")
    stop_at = long.token_ids[2]
    sp = SamplingParams(max_tokens=5, seed=4, stop_token_ids=(stop_at,), ignore_eos=True)
    [short] = engine.generate(PROMPTS[:1], n=1, sampling=sp)
    assert short.finish_reason == "stop" and short.token_ids[-1] == stop_at


def test_load_weights_swaps_and_names_the_version(policy_dir: Path) -> None:
    engine = make_engine("torch", policy_dir)
    state = perturbed_state_dict(policy_dir, scale=0.5)
    engine.load_weights(state, version=5)
    [c] = engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=8, seed=5))
    assert c.version == engine.version == 5
    ref = hf_logprobs(policy_dir, c.prompt_token_ids, c.token_ids, state_dict=state)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_equal_length_sequences_are_scored_in_one_forward_with_the_bits_of_each_alone(
    engine: TorchEngine,
) -> None:
    sp = SamplingParams(max_tokens=12, seed=6, ignore_eos=True)
    batch = engine.generate(PROMPTS[:1], n=8, sampling=sp)
    calls: list[int] = []
    handle = engine.model.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    try:
        scored = engine.score_many([(c.prompt_token_ids, c.token_ids) for c in batch], sp)
    finally:
        handle.remove()
    assert len(calls) == 1
    for c, (logprobs, routing) in zip(batch, scored, strict=True):
        assert logprobs == c.logprobs  # bitwise: batched in generate and here
        assert engine.score(c.prompt_token_ids, c.token_ids, sp) == (logprobs, routing)  # and alone


def test_mixed_lengths_score_like_each_sequence_alone(engine: TorchEngine) -> None:
    sp = SamplingParams(max_tokens=10, seed=8)
    batch = engine.generate(PROMPTS, n=2, sampling=sp)
    for c in batch:
        assert engine.score(c.prompt_token_ids, c.token_ids, sp)[0] == c.logprobs


def test_sampling_never_draws_a_masked_token(engine: TorchEngine) -> None:
    greedy = engine.generate(PROMPTS, n=1, sampling=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = engine.generate(PROMPTS, n=1, sampling=SamplingParams(max_tokens=10, top_k=1, seed=3, ignore_eos=True))
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


def test_a_prompt_is_forwarded_once_for_its_n_samples(engine: TorchEngine) -> None:
    sp = SamplingParams(max_tokens=6, seed=9, ignore_eos=True)
    shapes: list[tuple[int, ...]] = []
    handle = engine.model.register_forward_hook(
        lambda m, a, kw, out: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        batch = engine.generate(PROMPTS[:2], n=4, sampling=sp)
    finally:
        handle.remove()
    width = max(len(engine.encode(p)) for p in PROMPTS[:2])
    assert shapes[0] == (2, width)  # the prompts, once each
    assert shapes[1] == (8, 1)  # then every sample's own next token
    assert [len(c.token_ids) for c in batch] == [6] * 8
    assert len({tuple(c.token_ids) for c in batch[:4]}) > 1  # the 4 samples of one prompt differ
    for c in batch:
        assert engine.score(c.prompt_token_ids, c.token_ids, sp)[0] == c.logprobs  # bitwise


def test_a_tied_head_model_hot_swaps_from_a_folder_that_holds_only_the_embedding(dense_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Qwen2-0.5B and most small models tie the LM head to the embedding; transformers saves only
    the embedding. Loading such a folder loads the head too, and the new version is what samples;
    a weight that is really missing still refuses the load."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.pretrain import save_policy

    tokenizer = load_tokenizer(dense_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_policy(tmp_path / f"v{seed}", Qwen2ForCausalLM(config), tokenizer)
        folders.append(tmp_path / f"v{seed}")
    assert "lm_head.weight" not in load_file(folders[1] / "model.safetensors")
    engine = make_engine("torch", folders[0], exact=False)
    sp = SamplingParams(max_tokens=8, seed=3, ignore_eos=True)
    engine.load_weights(folders[1], version=2)
    swapped = engine.generate(PROMPTS[:2], n=2, sampling=sp)
    fresh = make_engine("torch", folders[1], exact=False).generate(PROMPTS[:2], n=2, sampling=sp)
    assert [c.token_ids for c in swapped] == [c.token_ids for c in fresh]
    assert [c.logprobs for c in swapped] == [c.logprobs for c in fresh]
    state = load_file(folders[1] / "model.safetensors")
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(state, version=3)



def test_calls_from_an_event_loop_run_on_one_thread_of_the_engine_in_the_callers_context(policy_dir: Path) -> None:
    """A pool of threads taking turns would leave an OpenMP team on each (inference/engines/base.py
    `_on_own_thread`): every call from a loop, from any loop, runs on the engine's one thread, the
    caller's context variables with it, and answers as `generate` does."""
    import asyncio
    import contextvars
    import threading

    engine = make_engine("torch", policy_dir)
    request = contextvars.ContextVar("request", default=None)
    seen: list[tuple[int, object]] = []
    generate = engine.generate

    def recorded(*args, **kwargs):
        seen.append((threading.get_ident(), request.get()))
        return generate(*args, **kwargs)

    engine.generate = recorded
    sampling = SamplingParams(max_tokens=4, seed=3)

    async def one(i: int):
        request.set(i)
        return await engine.agenerate(["def add(a, b):"], sampling=sampling)

    async def many():
        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        answers = asyncio.run(many())
        asyncio.run(one(6))  # another loop
        assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
        assert sorted(r for _, r in seen) == list(range(7))
        alone = generate(["def add(a, b):"], sampling=sampling)[0].token_ids
        assert all(a[0].token_ids == alone for a in answers)
    finally:
        engine.close()
