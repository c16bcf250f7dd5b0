"""Tiny policies for the inference tests, built once per session under a tmp dir.

    .venv/bin/python -m pytest tests/inference -q -p no:django
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from inference.policies import PolicyConfig, build_policy, stdlib_corpus  # noqa: E402

# Strings that split differently under another pre-tokenizer or normaliser: digits, runs of
# spaces and newlines, tabs, a decomposed accent (NFC folds it), non-ASCII, special tokens.
TRICKY_TEXTS = [
    "x = 12345  # héllo\n\tdef  f(): return 'ü'",
    "e\u0301 <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "   \n\n  indented\r\n\ttab 3.14159e-10 0x1F",
    "import os, sys  # 日本語 🙂",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return stdlib_corpus(max_lines=20_000)


@pytest.fixture(scope="session")
def policies_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("policies")


@pytest.fixture(scope="session")
def dense_dir(policies_root: Path, corpus: list[str]) -> Path:
    return build_policy(policies_root / "dense", PolicyConfig(kind="dense"), corpus)


@pytest.fixture(scope="session")
def moe_dir(policies_root: Path, corpus: list[str]) -> Path:
    return build_policy(policies_root / "moe", PolicyConfig(kind="moe"), corpus)


@pytest.fixture(scope="session", params=["dense", "moe"])
def policy_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


def hf_logprobs(
    folder: Path,
    prompt: list[int],
    tokens: list[int],
    state_dict: dict[str, torch.Tensor] | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log_softmax(logits / T) of `tokens` after `prompt` from plain transformers, fp32; (T,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    ids = torch.tensor([prompt + tokens])  # (1, P + T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
