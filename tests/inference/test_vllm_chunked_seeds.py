"""A seeded request whose prompt vLLM prefills in chunks (prompts longer than a step's token budget,
or many arriving at once): vLLM rewinds the request's generator after each partial step with
`Generator.set_offset`, which a CPU generator does not have, so on the CPU build the engine died
("CPU Generator does not use offset") and took every request in flight with it. Flywheel's workers
rewind a CPU generator by its state (inference/vllm_worker.py): the request completes, with the
tokens and log-probs of the same seed prefilled in one step.

    .venv/bin/python -m pytest tests/inference/test_vllm_chunked_seeds.py -q
"""

from __future__ import annotations

from pathlib import Path

from inference.engines import SamplingParams, VLLMEngine

LONG = "def f(x):\n    return x + 1\n" * 12  # ~100 tokens of the tiny policy's tokenizer


def test_a_seeded_prompt_prefilled_in_chunks_samples_what_one_prefill_samples(dense_dir: Path) -> None:
    prompts = [LONG, LONG.replace("x", "y"), "import os"]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    whole = VLLMEngine(dense_dir, max_model_len=256)
    try:
        expected = whole.generate(prompts, n=1, sampling=sampling)
    finally:
        whole.close()
    chunked = VLLMEngine(dense_dir, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
    try:
        assert len(chunked._tokenizer(LONG)["input_ids"]) > 64  # at least three chunks of 32
        got = chunked.generate(prompts, n=1, sampling=sampling)
    finally:
        chunked.close()
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
