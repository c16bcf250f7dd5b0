"""Tiny offline policies: HF-format causal LMs (dense Qwen2, MoE Qwen3-MoE) with a byte-level BPE
tokenizer trained on Python's standard-library sources, so nothing is downloaded.

    .venv/bin/python -m training.pretrain /tmp/policy --kind moe --seconds 30

The folders are written with `save_pretrained`, so `AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained`, the trainer and vLLM all load them. No Django here.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]

# ChatML, like Qwen's; the generation prompt opens the assistant turn. Tools (OpenAI `tools`) are
# listed in a system block first; an assistant's tool calls follow its text as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (inference/tools.py parses them back);
# tool results are `tool` turns. Without tools or tool calls it renders plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' + TOOLS_PREAMBLE + '\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '</tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
).replace("TOOLS_PREAMBLE", "'To call a tool, answer <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>.'")

# Why two defences: transformers 5's AutoTokenizer maps model_type qwen2 to Qwen2Tokenizer even
# when tokenizer_config.json names another class (qwen2 is on its "incorrect hub class" list), and
# Qwen2Tokenizer rebuilds the pipeline with its own NFC + split regex. So we (1) train the BPE with
# exactly that pipeline, making every loader produce the same ids, and (2) still pin the class for
# loaders that honour it (qwen3_moe does).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Kind = Literal["dense", "moe"]


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of a tiny policy. head_dim >= 32 because vLLM's CPU attention supports 32, 64, ..."""

    kind: Kind = "dense"
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    max_position: int = 512
    seed: int = 0
    tokenizer_lines: int = 60_000


def stdlib_corpus(max_lines: int | None = None, min_chars: int = 8) -> list[str]:
    """Non-blank lines of the standard library's .py files, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        lines.extend(_file_lines(path, min_chars))
        if max_lines is not None and len(lines) >= max_lines:
            return lines[:max_lines]
    return lines


def _file_lines(path: Path, min_chars: int) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    return [line.rstrip() for line in text.splitlines() if len(line.strip()) >= min_chars]


def train_tokenizer(lines: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte representable) with Qwen2's normaliser and pre-tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        extra_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(cfg: PolicyConfig, eos_id: int) -> Qwen2Config | Qwen3MoeConfig:
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if cfg.kind == "dense":
        return Qwen2Config(**common)
    return Qwen3MoeConfig(
        **common,
        head_dim=cfg.hidden_size // cfg.num_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def init_model(cfg: PolicyConfig, eos_id: int) -> PreTrainedModel:
    torch.manual_seed(cfg.seed)
    cls = Qwen2ForCausalLM if cfg.kind == "dense" else Qwen3MoeForCausalLM
    return cls(model_config(cfg, eos_id)).float().eval()


def build_policy(
    folder: str | Path, cfg: PolicyConfig, corpus: Sequence[str] | None = None
) -> Path:
    """Train the tokenizer, initialise the model with `cfg.seed`, save both; returns the folder."""
    folder = Path(folder)
    lines = corpus if corpus is not None else stdlib_corpus(cfg.tokenizer_lines)
    tokenizer = train_tokenizer(lines, cfg.vocab_size)
    model = init_model(cfg, tokenizer.convert_tokens_to_ids(EOS))
    save_policy(folder, model, tokenizer)
    (folder / "policy_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    return folder


def save_policy(folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _pin_tokenizer_class(folder)


def _pin_tokenizer_class(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    path.write_text(json.dumps(config, indent=2))


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer exactly as trained (the class is pinned in tokenizer_config.json)."""
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def perturbed_state_dict(
    folder: str | Path, scale: float = 0.05, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A different, deterministic set of weights for the same architecture (tests, bench)."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
        out[name] = (tensor + scale * noise * (tensor.std() + 1e-3)).contiguous()
    return out


ProgressFn = Callable[[dict[str, float]], None]


def pretrain(
    folder: str | Path,
    corpus_lines: Sequence[str],
    seconds: float,
    progress: ProgressFn | None = None,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Next-token pretraining of the policy in `folder` for at most `seconds` wall time (and at
    most `max_steps` steps when given: a test needs a step count, not a machine's speed).

    Saves the weights back into `folder` (HF format) and returns the final stats. `progress`
    is called after every step with {"step", "loss", "elapsed", "seconds", "tokens"}.
    """
    folder = Path(folder)
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
    ids = _tokenise_stream(tokenizer, corpus_lines)  # (N,)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    stats = {"step": 0.0, "loss": math.nan, "elapsed": 0.0, "seconds": seconds if math.isfinite(seconds) else None,
             "tokens": 0.0, "max_steps": max_steps}
    start = time.monotonic()
    while time.monotonic() - start < seconds and (max_steps is None or stats["step"] < max_steps):
        batch = _random_windows(ids, batch_size, seq_len, gen)  # (B, T)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        stats.update(step=stats["step"] + 1, loss=loss.item(), tokens=stats["tokens"] + batch.numel())
        stats["elapsed"] = time.monotonic() - start
        if progress is not None:
            progress(dict(stats))
    model.eval().save_pretrained(folder)
    return stats


def _tokenise_stream(tokenizer: PreTrainedTokenizerFast, lines: Sequence[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    encoded = tokenizer(list(lines), add_special_tokens=False)["input_ids"]
    flat: list[int] = []
    for row in encoded:
        flat.extend(row)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.long)


def _random_windows(
    ids: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    seq_len = min(seq_len, ids.numel() - 1)
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])  # (B, T)


def sample_lines(lines: Sequence[str], n: int, seed: int = 0) -> list[str]:
    """A deterministic subset, e.g. held-out prompts."""
    rng = random.Random(seed)
    return rng.sample(list(lines), min(n, len(lines)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    parser.add_argument("--kind", choices=["dense", "moe"], default="dense")
    parser.add_argument("--seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    corpus = stdlib_corpus()
    build_policy(args.folder, PolicyConfig(kind=args.kind), corpus[:60_000])
    if args.seconds > 0:
        stats = pretrain(args.folder, corpus, args.seconds)
        print(f"pretrained {int(stats['step'])} steps, loss {stats['loss']:.3f}")
    print(args.folder)


if __name__ == "__main__":
    main()
