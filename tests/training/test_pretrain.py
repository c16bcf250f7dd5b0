"""Tiny HF-format policies: loadable by transformers, deterministic, one tokenisation everywhere.

    .venv/bin/python -m pytest tests/training/test_pretrain.py -q
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.inference.conftest import TRICKY_TEXTS
from training.pretrain import (
    PolicyConfig,
    build_policy,
    load_tokenizer,
    pretrain,
    stdlib_corpus,
)


def test_automodel_loads_the_built_folders(dense_dir: Path, moe_dir: Path) -> None:
    dense = AutoModelForCausalLM.from_pretrained(str(dense_dir))
    moe = AutoModelForCausalLM.from_pretrained(str(moe_dir))
    assert type(dense).__name__ == "Qwen2ForCausalLM"
    assert type(moe).__name__ == "Qwen3MoeForCausalLM"
    assert next(dense.parameters()).dtype == torch.float32


def test_the_moe_policy_has_4_experts_and_routes_top_2(moe_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(moe_dir))
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)


def test_autotokenizer_gives_the_trained_ids(policy_dir: Path) -> None:
    auto, trained = AutoTokenizer.from_pretrained(str(policy_dir)), load_tokenizer(policy_dir)
    for text in TRICKY_TEXTS:
        assert auto.encode(text) == trained.encode(text), text
    assert auto.decode(trained.encode(TRICKY_TEXTS[0])) == TRICKY_TEXTS[0]


def test_the_chat_template_renders_chatml_with_special_tokens(policy_dir: Path) -> None:
    auto, trained = AutoTokenizer.from_pretrained(str(policy_dir)), load_tokenizer(policy_dir)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    text = trained.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    ids = trained.encode(text)
    assert ids[0] == trained.convert_tokens_to_ids("<|im_start|>")
    assert auto.encode(text) == ids


def test_building_twice_with_one_seed_gives_identical_weights(tmp_path: Path) -> None:
    lines = stdlib_corpus(max_lines=3_000)
    cfg = PolicyConfig(kind="moe", vocab_size=1024, seed=3)
    a = AutoModelForCausalLM.from_pretrained(str(build_policy(tmp_path / "a", cfg, lines)))
    b = AutoModelForCausalLM.from_pretrained(str(build_policy(tmp_path / "b", cfg, lines)))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_pretrain_lowers_the_loss_and_saves_in_place(tmp_path: Path) -> None:
    lines = stdlib_corpus(max_lines=3_000)
    folder = build_policy(tmp_path / "p", PolicyConfig(vocab_size=1024), lines)
    before = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    seen: list[dict[str, float]] = []
    # Bounded by steps, not by the clock: a busy machine must not change what is tested.
    stats = pretrain(folder, lines, seconds=3600.0, progress=seen.append, batch_size=8, seq_len=64, max_steps=6)
    assert stats["step"] == 6 and len(seen) == stats["step"]
    assert seen[-1]["loss"] < seen[0]["loss"]
    after = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
