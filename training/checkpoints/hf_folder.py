"""Checks that a local Hugging Face folder can be a project's base policy (no Django; called by
`manage.py bootstrap_policy --from PATH`).

Accepted: a causal LM of the Qwen2, Qwen3, Qwen3-MoE or Llama families (both engines run them
with their own code), weights in safetensors only (a pickle file can run code when loaded), no
`auto_map` (remote code is never run), and a tokenizer with a chat template in the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "llama": "Llama"}
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class FolderRefused(ValueError):
    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}. {fix}")
        self.message, self.fix = message, fix


def hf_folder_check(path: str | Path) -> dict[str, Any]:
    """The folder's config.json when it qualifies; raises FolderRefused saying why and what to do."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FolderRefused(f"{folder} has no config.json", "Point --from at a Hugging Face model folder "
                            "(config.json, *.safetensors, tokenizer files), e.g. one saved by save_pretrained.")
    config = json.loads((folder / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise FolderRefused(f"model_type {kind!r} is not supported",
                            f"Use a model of the {', '.join(FAMILIES.values())} families.")
    if config.get("auto_map"):
        raise FolderRefused("config.json asks for remote code (auto_map)",
                            "Flywheel never runs code from a model folder; use a model that transformers supports natively.")
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        raise FolderRefused(f"the folder holds pickled weights ({', '.join(pickled[:3])})",
                            "Convert them to safetensors (save_pretrained(safe_serialization=True)) and remove them.")
    if not any(folder.glob("*.safetensors")):
        raise FolderRefused("no *.safetensors weights in the folder", "Save the model with safetensors.")
    tokenizer = _tokenizer_config(folder)
    if not (tokenizer.get("chat_template") or (folder / "chat_template.jinja").is_file()
            or (folder / "chat_template.json").is_file()):
        raise FolderRefused("the tokenizer has no chat template", "Add chat_template.jinja (or chat_template in "
                            "tokenizer_config.json): the serving endpoint renders chat messages with it.")
    return config


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    if not (folder / "tokenizer.json").is_file():
        raise FolderRefused("no tokenizer.json in the folder", "Save the fast tokenizer next to the weights "
                            "(tokenizer.save_pretrained(folder)).")
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def weight_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in the folder's *.safetensors, from their JSON headers only
    (no torch: the web process validates a LoRA's target modules with it)."""
    shapes: dict[str, list[int]] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with shard.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def linear_module_names(path: str | Path) -> list[str]:
    """The leaf names of the folder's matrix weights (`q_proj`, `down_proj`, `lm_head`, ...): the
    names a LoRA's `target_modules` may give. Norms and 1-D or fused 3-D expert tensors are not
    modules PEFT's LoRA wraps."""
    names = {k.removesuffix(".weight").rsplit(".", 1)[-1]
             for k, shape in weight_shapes(path).items() if k.endswith(".weight") and len(shape) == 2}
    return sorted(n for n in names if "norm" not in n)
