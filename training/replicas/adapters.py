"""Serving adapter versions as adapters: one engine per base, shared by every served project.

A project whose production is a LoRA version (`PolicyVersion.adapter_base`) is served by an
engine that holds the base's weights with LoRA enabled; each version is an adapter on it under a
new name (inference/engines/adapters.py `AdapterView`), so a promotion hot-loads an adapter, the
canary is a second adapter, and a rollback or retirement unloads one; nothing restarts. Projects
whose bases are the same weights (the base's checkpoint hash) share the engine
(`serve_policy --project A --project B`). A full version is served as before (its own engine);
an adapter over another base than the host's is served merged.

    .venv/bin/python -m pytest tests/training/replicas/test_adapter_serving.py -q
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

from inference.engines import Engine, EngineFactory, make_engine
from inference.engines.adapters import ADAPTER_CONFIG
from training.models import PolicyVersion
from training.versions.services import checkpoint_store, policy_adapter_folder, policy_folder

# Ranks vLLM's LoRA config accepts (vllm.config.lora: max_lora_rank).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def base_key(base: PolicyVersion) -> str:
    """The identity of a base's weights across projects: its checkpoint hash when stored (the
    same weights registered in two projects have two manifests but one checkpoint hash)."""
    if base.manifest_hash:
        return str(checkpoint_store().manifest(base.manifest_hash)["checkpoint_hash"])
    return f"folder:{policy_folder(base)}"


def lora_settings(kind: str, adapter_dir: Path) -> dict[str, Any]:
    """The engine settings that let a `kind` engine hold adapters like the one in `adapter_dir`."""
    if kind == "torch":
        return {}
    rank = settings.FLYWHEEL_SERVE_MAX_LORA_RANK or int(json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["r"])
    supported = next((r for r in VLLM_RANKS if r >= rank), rank)
    return {"enable_lora": True, "max_loras": settings.FLYWHEEL_SERVE_MAX_LORAS,
            "max_cpu_loras": settings.FLYWHEEL_SERVE_MAX_LORAS, "max_lora_rank": supported}


class AdapterHosts:
    """The serving process's base engines, one per base (`base_key`), made on first need."""

    def __init__(self, factory: EngineFactory) -> None:
        self.factory = factory
        self.by_key: dict[str, Engine] = {}

    def host_for(self, version: PolicyVersion) -> tuple[Engine, str] | None:
        """The engine holding `version`'s base (started if none does), with the base's key; None
        for a full version, or when adapters are served merged (FLYWHEEL_SERVE_ADAPTERS=0)."""
        if version.adapter_base_id is None or not settings.FLYWHEEL_SERVE_ADAPTERS:
            return None
        base = version.adapter_base
        key = base_key(base)
        if key not in self.by_key:
            extra = lora_settings(self.factory.kind, policy_adapter_folder(version))
            self.by_key[key] = make_engine(self.factory.kind, policy_folder(base), version=base.number,
                                           **{**self.factory.settings, **extra})
        return self.by_key[key], key

    def close(self) -> None:
        for engine in self.by_key.values():
            engine.close()
        self.by_key.clear()


def adapter_folder_or_merged(version: PolicyVersion, host_key: str | None) -> Path:
    """What a server whose host holds the base `host_key` loads for `version`: the adapter alone
    when it is an adapter over that base, else the full (or merged) weights."""
    if version.adapter_base_id is not None and host_key is not None and base_key(version.adapter_base) == host_key:
        return policy_adapter_folder(version)
    return policy_folder(version)


FolderOf = Callable[[PolicyVersion], Path]
