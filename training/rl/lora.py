"""LoRA adapters with PEFT: a run trains an adapter over its frozen base, saves it in PEFT's own
layout (`adapter_model.safetensors` + `adapter_config.json`, what `PeftModel.from_pretrained`
and vLLM's `LoRARequest` read), and hands the engines the merged weights.

Plain torch + PEFT, no Django. The model stays the transformers model: PEFT's `get_peft_model`
swaps its target Linear layers for LoRA layers in place, so the trainer's forward keeps its
signature (`logits_to_keep`, `past_key_values`: the shared-prefix and tail forwards) and only
the adapter's parameters require a gradient.

    .venv/bin/python -m pytest tests/training/rl/test_lora.py -q -p no:django
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from training.rl.config import AdapterConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names (peft.utils.SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"
# PeftModel.save_pretrained's keys carry the wrapper's prefix; our model is the wrapped one.
PEFT_PREFIX = "base_model.model."


class AdapterMismatch(ValueError):
    """A run's adapter settings cannot continue the adapter its base version holds."""


def lora_config(adapter: AdapterConfig) -> LoraConfig:
    return LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                      target_modules=list(adapter.target_modules), bias="none", task_type="CAUSAL_LM")


def adapter_of(folder: Path) -> AdapterConfig:
    """The AdapterConfig an adapter folder was trained with (its adapter_config.json)."""
    raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    targets = raw["target_modules"]
    return AdapterConfig(kind="lora", rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                         dropout=float(raw.get("lora_dropout") or 0.0),
                         target_modules=tuple(sorted(targets) if isinstance(targets, list | set) else [targets]))


def lora_attach(model: PreTrainedModel, adapter: AdapterConfig, adapter_dir: Path | None = None) -> PreTrainedModel:
    """`model` with a trainable LoRA adapter in its target layers and every base weight frozen:
    a fresh one (B = 0: the model's outputs unchanged), or the adapter saved in `adapter_dir`,
    which must have the same rank, alpha and targets. Returns the same model object."""
    if adapter_dir is not None:
        saved = adapter_of(adapter_dir)
        if not adapter.same_adapter(saved):
            raise AdapterMismatch(
                f"the base version's adapter has rank {saved.rank}, alpha {saved.alpha:g}, targets "
                f"{sorted(saved.target_modules)}; the run asks for rank {adapter.rank}, alpha {adapter.alpha:g}, "
                f"targets {sorted(adapter.target_modules)}. Use the base version's adapter settings to go on "
                "training it, or train \"full\"")
    peft = get_peft_model(model, lora_config(adapter))
    if adapter_dir is not None:
        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(adapter_dir / ADAPTER_WEIGHTS).items()}
        result = set_peft_model_state_dict(peft.base_model.model, state)
        if result.unexpected_keys:
            raise AdapterMismatch(f"{adapter_dir} holds tensors this model has no place for: "
                                  f"{result.unexpected_keys[:3]}")
    return peft.base_model.model  # the same object as `model`, its Linear layers now LoRA layers


def is_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLayer) for m in model.modules())


def adapter_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`),
    cast to `dtype` when given (a bf16 run's adapter is served in bf16)."""
    return {PEFT_PREFIX + k: v.detach().to(dtype or v.dtype).contiguous()
            for k, v in get_peft_model_state_dict(model).items()}


def lora_save(model: nn.Module, folder: Path, precision: str = "fp32") -> None:
    """The adapter as PeftModel.save_pretrained writes it: weights (in the serving dtype of a
    resolved `precision`) and config, nothing of the base."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if precision == "bf16" else None
    save_file(adapter_state_dict(model, dtype), folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = model.peft_config[ADAPTER_NAME]
    config.save_pretrained(str(folder))


def lora_load(model: nn.Module, folder: Path) -> None:
    """`lora_save`'s adapter weights into `model`'s LoRA layers (the same rank and targets)."""
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(folder / ADAPTER_WEIGHTS).items()}
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise AdapterMismatch(f"{folder} holds tensors this model has no place for: {result.unexpected_keys[:3]}")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain weights the model computes with (a LoRA layer's W + scale * B @ A), under the
    base model's own names: what an engine loads. The model is left as it is (no in-place merge
    and unmerge, whose W + d - d drifts the frozen base by a rounding each swap)."""
    if not is_lora(model):
        return model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            with torch.no_grad():
                out[f"{name}.weight"] = base.weight + module.get_delta_weight(ADAPTER_NAME).to(base.weight.dtype)
            if getattr(base, "bias", None) is not None:
                out[f"{name}.bias"] = base.bias.detach()
    for key, value in model.state_dict().items():
        if ".lora_" in key or ".base_layer." in key:
            continue
        out.setdefault(key, value)
    return out


def merge_adapter(base_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """An HF folder with the base's weights and the adapter merged in (PEFT's `merge_and_unload`)
    and the base's config and tokenizer files: what the engines, the gate and serving load.
    Written to a temporary folder renamed into place (a reader never sees half of it)."""
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for path in base_dir.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
                shutil.copy2(path, tmp / path.name)
        merged.save_pretrained(str(tmp))
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():  # another process merged it meanwhile: theirs is the same
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
