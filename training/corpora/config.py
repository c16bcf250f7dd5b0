"""Typed options of a mid-training run and of replay rollouts (torch- and Django-free, so the API
validates them without importing either)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MidtrainConfig:
    """Packed next-token training on a corpus's training files: `steps` optimiser steps, or as many
    as fit in `minutes` (one of the two); rows of `seq_len` tokens, `batch_size` rows a step."""

    corpus: int
    steps: int | None = None
    minutes: float | None = None
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    warmup: float = 0.02  # share of the run spent warming the learning rate up
    seed: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MidtrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown mid-training options {unknown}; known: {sorted(known)}")
        out = cls(**dict(data))
        if (out.steps is None) == (out.minutes is None):
            raise ValueError("give either steps or minutes (one of the two)")
        if out.steps is not None and not 1 <= int(out.steps) <= 10_000_000:
            raise ValueError(f"steps must be in [1, 10,000,000], got {out.steps!r}")
        if out.minutes is not None and not 0 < float(out.minutes) <= 7 * 24 * 60:
            raise ValueError(f"minutes must be in (0, 10080], got {out.minutes!r}")
        if not 2 <= out.seq_len <= 32_768 or not 1 <= out.batch_size <= 4096:
            raise ValueError(f"seq_len in [2, 32768] and batch_size in [1, 4096], got {out.seq_len}, {out.batch_size}")
        if not 0 < out.lr <= 1 or not 0 <= out.warmup < 1:
            raise ValueError(f"lr in (0, 1] and warmup in [0, 1), got {out.lr}, {out.warmup}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplayConfig:
    """Replay rollouts of a run: `share` of its group-rollout prompts cut from the training lines
    of corpus `corpus` (the project's newest when None), each a line's first few characters up to
    half of it, rewarded by the accepted characters against the rest of the real line."""

    share: float = 0.5
    corpus: int | None = None
    min_prefix: int = 4

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ReplayConfig | None:
        if not data:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown replay options {unknown}; known: {sorted(known)}")
        out = cls(**data)
        if not 0 < float(out.share) <= 1:
            raise ValueError(f"replay share must be in (0, 1], got {out.share!r}")
        if not 1 <= int(out.min_prefix) <= 40:
            raise ValueError(f"replay min_prefix must be in [1, 40], got {out.min_prefix!r}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
