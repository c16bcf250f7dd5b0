"""Typed RL run config, torch-free so the web side can validate a run without torch.

    python -c "from training.rl.config import RLConfig; print(RLConfig().to_dict())"
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RLConfig:
    """Every knob of one RL update; saved with each checkpoint (`to_dict`)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    eps: float = 0.2  # PPO clip below: ratio >= 1 - eps
    eps_high: float = 0.28  # PPO clip above (DAPO-style clip-higher): ratio <= 1 + eps_high
    is_cap: float = 2.0  # C in min(pi_old / mu, C): truncated importance weight
    beta: float = 0.0  # weight of the k3 KL to the reference policy
    # The reference policy of that KL: "base", the weights the run starts from; or "production",
    # what is served, whose distance to a candidate the gate bounds (kl_budget). A lineage that runs
    # ahead of a lagging production drifts past that bound and every later candidate is refused.
    kl_to: str = "base"
    # A trust region around that reference: a run stops its group rounds once a round's measured
    # KL to it (token-mean k3 on the round's own samples, the gate's estimator) exceeds kl_stop.
    # None: no stop. With kl_to = "production" and kl_stop below the gate's kl_budget, candidates
    # stay inside the region the gate admits instead of drifting out of it run after run.
    kl_stop: float | None = None
    # The same region for length: a run stops its group rounds once a round's mean completion
    # length (tokens, empties included: the gate's length_drift estimator) is outside
    # [1/length_stop, length_stop] times production's on the round's own prompts. None: no stop.
    # Below the gate's length_ratio_max, candidates stay inside the length bound it admits.
    length_stop: float | None = None
    max_staleness: int = 4  # K: samples more than K policy versions behind are dropped
    group_normalize_std: bool = False  # divide group-relative advantages by the group std
    baseline_decay: float = 0.9  # EMA decay of the per-task running baseline (live samples)
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    logprob_chunk_size: int = 1024  # rows per chunk of the selective log-softmax
    router_replay: bool = True  # replay recorded MoE routing in the trainer forward
    # Forward each distinct prompt of a micro-batch once and let its rows (a group's G completions)
    # attend to that one copy: same loss and gradient as forwarding every row whole, with the
    # prompt's share of the compute paid once per group instead of G times.
    shared_prefix: bool = True
    batch_invariant: bool = True  # recomputed log-probs bitwise equal to the torch engine's

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid RLConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        checks = [
            (self.lr > 0, "lr must be > 0"),
            (0 < self.eps < 1, "eps must be in (0, 1)"),
            (self.eps_high > 0, "eps_high must be > 0"),
            (self.is_cap >= 1, "is_cap (C) must be >= 1"),
            (self.beta >= 0, "beta must be >= 0"),
            (self.kl_to in ("base", "production"), 'kl_to must be "base" or "production"'),
            (self.kl_stop is None or self.kl_stop > 0, "kl_stop must be > 0 (or null: no stop)"),
            (self.length_stop is None or self.length_stop > 1, "length_stop must be > 1 (or null: no stop)"),
            (self.max_staleness >= 0, "max_staleness (K) must be >= 0"),
            (0 <= self.baseline_decay < 1, "baseline_decay must be in [0, 1)"),
            (self.grad_clip > 0, "grad_clip must be > 0"),
            (self.micro_batch_size >= 1, "micro_batch_size must be >= 1"),
            (self.logprob_chunk_size >= 1, "logprob_chunk_size must be >= 1"),
        ]
        return [msg for ok, msg in checks if not ok]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RLConfig keys: {unknown}; known keys: {sorted(known)}")
        return cls(**data)


GROUP_KEYS = {"prompts": (1, 1024), "G": (2, 128), "max_tokens": (1, 512), "rounds": (1, 64)}


def group_config(group: Any) -> dict[str, int] | None:
    """A run's group rollouts ({"prompts": P, "G": G, "max_tokens": N, "rounds": R}), checked;
    None: off. R rounds: sample, score and update R times in one run, each round from the weights
    the previous one left (on-policy), so one run moves as far as R short runs without paying a
    run's and a gate's fixed costs R times."""
    if not group:
        return None
    if not isinstance(group, dict) or set(group) - set(GROUP_KEYS):
        raise ValueError(f"group must be an object with keys {sorted(GROUP_KEYS)}, got {group!r}")
    out = {}
    for key, value in group.items():
        low, high = GROUP_KEYS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"group.{key} must be an integer in [{low}, {high}], got {value!r}")
        out[key] = value
    return out


AGENT_KEYS = {"tasks": (1, 256), "G": (2, 64), "max_turns": (1, 32), "max_tokens": (8, 1024),
              "summary_budget": (64, 32_768)}
AGENT_DEFAULTS = {"G": 4, "max_turns": 6, "max_tokens": 96, "summary_budget": 1024, "tests_weight": 1.0}


def agent_config(agent: Any) -> dict[str, Any] | None:
    """A run's agent rollouts ({"tasks": N, "G": G, "max_turns": T, "max_tokens": M,
    "summary_budget": B, "tests_weight": W}), checked and completed with the defaults; None: off.
    N of the project's agent tasks per run, G rollouts of each through the run's own weights;
    reward W x the tests' pass share + the spec's judged aspects (docs/agents.md)."""
    if not agent:
        return None
    known = [*AGENT_KEYS, "tests_weight"]
    if not isinstance(agent, dict) or set(agent) - set(known) or "tasks" not in agent:
        raise ValueError(f"agent must be an object with `tasks` and any of {sorted(known)}, got {agent!r}")
    out: dict[str, Any] = {**AGENT_DEFAULTS}
    for key, value in agent.items():
        if key == "tests_weight":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
                raise ValueError(f"agent.tests_weight must be a number in [0, 100], got {value!r}")
            out[key] = float(value)
            continue
        low, high = AGENT_KEYS[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"agent.{key} must be an integer in [{low}, {high}], got {value!r}")
        out[key] = value
    return out


# A run's compute precision. "fp32": everything in float32 (the default: the trainer's log-probs
# equal the torch engine's bit for bit, tests/training/rl/test_engine_parity.py). "bf16": float32
# master weights and AdamW state, forward and backward under bf16 autocast, the candidate's weights
# saved (served, and delta'd against their parent) in bf16. "auto": bf16 where the hardware computes
# it natively (a CPU with AVX-512 BF16 or AMX, a CUDA GPU of compute capability >= 8), else fp32;
# resolved by the worker that trains (training.rl.precision.resolve_precision), recorded in the result.
PRECISIONS = ("fp32", "bf16", "auto")


def precision_value(value: Any) -> str:
    """A run's `precision` setting, checked (None: "fp32")."""
    if value is None:
        return "fp32"
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {value!r}")
    return str(value)


# The linear projections a LoRA adapter sits on by default: q_proj and v_proj, PEFT's own default
# for Qwen2/Llama/Mistral (peft.utils.constants TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING),
# what its users expect when they name no targets. Measured on the demo policy (bench/delta.py):
# rank 8 on q/v stores ~130x fewer bytes than the base, on q/k/v/o 65x. Name more in
# `target_modules` (attention's four, the MLP's three) for more capacity.
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """What a run trains: `full` (every weight; the default) or `lora` (a PEFT LoRA adapter of
    `rank` and `alpha` on the `target_modules` linear layers, the base frozen). A LoRA version is
    an adapter over a named base version; its checkpoint and delta are the adapter only.

    JSON: "full", or {"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"]} (any key but kind may be left out)."""

    kind: str = "full"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        problems = self.problems()
        if problems:
            raise ValueError("invalid adapter: " + "; ".join(problems))

    def problems(self) -> list[str]:
        names = self.target_modules
        checks = [
            (self.kind in ("full", "lora"), f'adapter.kind must be "full" or "lora", got {self.kind!r}'),
            (isinstance(self.rank, int) and not isinstance(self.rank, bool) and 1 <= self.rank <= 1024,
             f"adapter.rank must be an integer in [1, 1024], got {self.rank!r}"),
            (_number(self.alpha) and self.alpha > 0, f"adapter.alpha must be a number > 0, got {self.alpha!r}"),
            (_number(self.dropout) and 0 <= self.dropout < 1,
             f"adapter.dropout must be a number in [0, 1), got {self.dropout!r}"),
            (len(names) > 0 and all(isinstance(n, str) and n.isidentifier() for n in names),
             f"adapter.target_modules must be a non-empty list of module names, got {list(names)!r}"),
        ]
        return [msg for ok, msg in checks if not ok]

    @property
    def lora(self) -> bool:
        return self.kind == "lora"

    @property
    def scale(self) -> float:
        """alpha / rank: what B @ A is multiplied by (PEFT's `scaling`, without rsLoRA)."""
        return float(self.alpha) / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "target_modules": list(self.target_modules)}

    def same_adapter(self, other: AdapterConfig) -> bool:
        """Whether a run with `self` can go on training an adapter trained with `other` (the
        shapes and the layers it sits on are the same; dropout is a training-time choice)."""
        return (self.rank, float(self.alpha), set(self.target_modules)) == (
            other.rank, float(other.alpha), set(other.target_modules))

    @classmethod
    def from_value(cls, data: Any) -> AdapterConfig:
        """From JSON: None or "full" (full fine-tuning), "lora" (the LoRA defaults), or an object."""
        if data is None or data == "full":
            return cls()
        if data == "lora":
            return cls(kind="lora")
        if not isinstance(data, dict):
            raise ValueError(f'adapter must be "full", "lora" or an object with "kind", got {data!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown adapter keys: {unknown}; known keys: {sorted(known)}")
        targets = data.get("target_modules", LORA_DEFAULT_TARGETS)
        if isinstance(targets, str) or not isinstance(targets, list | tuple):
            raise ValueError(f"adapter.target_modules must be a list of module names, got {targets!r}")
        return cls(**{**data, "kind": data.get("kind", "lora"), "target_modules": tuple(targets)})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
