"""Fixtures for the kernels tests: a tiny random-init Qwen2 (seeded) and its HF folder.

Run: `.venv/bin/python -m pytest tests/kernels -q`
"""

from __future__ import annotations

import os

import torch

# Triton reads this when kernels are defined, so it must be set before kernels.triton_ops is
# imported; on a CUDA machine the real kernels run instead of the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

VOCAB = 2048


def tiny_qwen2(dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model_fp32() -> Qwen2ForCausalLM:
    return tiny_qwen2(torch.float32)


@pytest.fixture(scope="module")
def model_bf16() -> Qwen2ForCausalLM:
    return tiny_qwen2(torch.bfloat16)
