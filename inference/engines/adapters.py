"""Versions that are LoRA adapters, served over one engine holding their base (kind-independent).

    host = make_engine("vllm-async", base_dir, enable_lora=True, max_loras=4, max_lora_rank=16)
    production = AdapterView(host, adapter_v3_dir, version=3)   # loads under a new name
    canary = AdapterView(host, adapter_v4_dir, version=4)       # a second adapter, same engine
    production.load_weights(adapter_v5_dir, 5)                 # hot-load v5, then unload v3
    canary.close()                                             # unload: the canary is gone

An `AdapterView` is an `Engine` (what `inference.serving.PolicyServer` holds per role), so the
serving process routes, records and swaps as it does for full weights: a request on the view
generates on the host with the view's adapter and is recorded under the view's version. Every
load is a new adapter name in the host (never reused: vLLM keys its adapter cache and its prefix
cache by the name and id), and the previous adapter is unloaded once no request uses it. One host
may carry views of several projects (serve_policy --project A --project B): a view is reachable
only through its project's server, so a key of A never reaches B's adapter.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.engines.base import Completion, Engine, Prompts, SamplingParams, WeightsSource

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a folder holding it is an adapter


def is_adapter_folder(source: WeightsSource) -> bool:
    return isinstance(source, str | Path) and (Path(source) / ADAPTER_CONFIG).is_file()


class AdapterView(Engine):
    """One version's adapter on a shared host engine; `close` unloads it (the host stays)."""

    def __init__(self, host: Engine, folder: str | Path, version: int = 0) -> None:
        super().__init__(folder, version)
        self.host = host
        self._cond = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self.adapter: str | None = host.adapter_add(Path(folder))
        # Called with each adapter name this view unloads (the serving process's record of what
        # its replica holds).
        self.on_unload: Callable[[str], None] | None = None

    @property
    def tokenizer(self) -> Any:
        return self.host.tokenizer

    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        return self.host.home_loop()

    # --- generation ---------------------------------------------------------------------------
    def _take(self) -> tuple[str, int]:
        with self._cond:
            if self.adapter is None:
                raise RuntimeError("this adapter was unloaded")
            name, version = self.adapter, self._version
            self._in_flight[name] = self._in_flight.get(name, 0) + 1
            return name, version

    def _give(self, name: str) -> None:
        with self._cond:
            self._in_flight[name] -= 1
            self._cond.notify_all()

    def generate(self, prompts: Prompts, n: int = 1, sampling: SamplingParams | None = None) -> list[Completion]:
        name, version = self._take()
        try:
            return _as_version(self.host.generate_on(name, prompts, n, sampling), version)
        finally:
            self._give(name)

    async def agenerate(self, prompts: Prompts, n: int = 1,
                        sampling: SamplingParams | None = None) -> list[Completion]:
        name, version = self._take()
        try:
            return _as_version(await self.host.agenerate_on(name, prompts, n, sampling), version)
        finally:
            self._give(name)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Completion]:
        return self.generate(prompts, n, sampling)

    # --- weights ------------------------------------------------------------------------------
    def load_weights(self, source: WeightsSource, version: int) -> None:
        """Hot-loads another adapter of the same base under a new name; requests already on the
        old one finish on it, then it is unloaded."""
        if not is_adapter_folder(source):
            raise ValueError(f"{source} is not a PEFT adapter folder; an adapter view loads adapters only")
        new = self.host.adapter_add(Path(source))
        with self._cond:
            old, self.adapter, self._version, self.model_dir = self.adapter, new, version, Path(source)
        if old is not None:
            self._unload(old)

    def _load_weights(self, source: WeightsSource) -> None:  # load_weights is overridden
        raise NotImplementedError

    def close(self) -> None:
        with self._cond:
            old, self.adapter = self.adapter, None
        if old is not None:
            self._unload(old)

    def _unload(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight.get(name, 0) == 0, timeout=300)
            self._in_flight.pop(name, None)
        self.host.adapter_remove(name)
        if self.on_unload is not None:
            self.on_unload(name)


def _as_version(completions: list[Completion], version: int) -> list[Completion]:
    for c in completions:
        c.version = version
    return completions
