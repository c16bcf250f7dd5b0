"""Tiny policies for the inference tests, built once per session under a tmp dir.

    .venv/bin/python -m pytest tests/inference -q -p no:django
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.conftest import TRICKY_TEXTS  # noqa: E402,F401 - the tests import it from here


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
