"""What a training run is asked to do (`RunSettings`) and when the beat starts one (`Schedule`):
typed, frozen, checked in one place, torch-free so the web side validates them before anything
is queued. The one home of the defaults.

    from training.runs.settings import PRESETS, RunSettings, Schedule
    s = RunSettings.from_dict({"steps": 8, "rl": {"lr": 2e-3}})
    RunSettings.from_dict(s.to_dict()) == s            # JSON round trip: Celery, the beat, the DB
    PRESETS["demo"].to_dict()                          # a beat entry's kwargs (training.tasks.train_maybe)

A `TrainingRun` stores `RunSettings.to_dict()` in `settings` when it is created and never
rewrites it; what the run produced goes to `result`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from core.errors import BadRequest
from training.corpora.config import ReplayConfig
from training.rl.config import (
    PRECISIONS,
    AdapterConfig,
    RLConfig,
    agent_config,
    group_config,
    precision_value,
)

# How to fix each setting, for the error a refused one gets.
FIXES = {
    "steps": "Give a positive number of optimiser steps.",
    "batch_size": "Give a positive batch size.",
    "seed": "Give an integer seed.",
    "max_samples": "Give a positive number of samples.",
    "epochs": "Give the passes over a run's data, e.g. 2 (or leave it out and give steps).",
    "rl": "Use RLConfig field names and valid values (training/rl/config.py).",
    "group": 'E.g. {"prompts": 64, "G": 8, "max_tokens": 16}.',
    "agent": 'E.g. {"tasks": 8, "G": 4, "max_turns": 6}.',
    "replay": 'E.g. {"share": 0.5} with group rollouts (the corpus: the project\'s newest unless "corpus": ID).',
    "trajectory_ids": "Give a list of trajectory ids (or leave it out: the run's data window).",
    "min_new": "Give the number of new rewarded trajectories that starts a run, e.g. 64.",
    "every_minutes": "Give the minutes after which any new data starts a run, e.g. 60.",
    "adapter": ('Give "full", or {"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0, '
                '"target_modules": ["q_proj", "v_proj"]} (rank an integer in [1, 1024], alpha > 0, dropout in [0, 1)).'),
    "precision": ('Give "fp32" (the default), "bf16" (fp32 master weights, bf16 compute, weights served in bf16) '
                  'or "auto" (bf16 where the hardware computes it natively, else fp32).'),
    "keys": "Leave out the unknown keys.",
}


class SettingsInvalid(BadRequest):
    """Refused run settings: every problem, and how to fix each."""

    def __init__(self, problems: list[tuple[str, str]], what: str = "run settings") -> None:
        self.problems = [message for _, message in problems]
        fix = " ".join(dict.fromkeys(FIXES[name] for name, _ in problems))
        super().__init__(f"invalid {what}: " + "; ".join(self.problems), fix)


def _number(data: Mapping[str, Any], name: str, kind: type, problems: list[tuple[str, str]]) -> Any:
    value = data[name]
    if value is None or isinstance(value, bool):
        problems.append((name, f"{name} must be a number, got {value!r}"))
        return None
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON's 1e400 is an infinite float
        problems.append((name, f"{name} must be a number, got {value!r}"))
        return None


def _unknown(data: Mapping[str, Any], known: set[str]) -> list[tuple[str, str]]:
    unknown = sorted(set(data) - known)
    return [("keys", f"unknown keys {unknown}; known keys: {sorted(known)}")] if unknown else []


@dataclass(frozen=True)
class RunSettings:
    """Everything one training run is asked to do. `group` (group rollouts, `group_config`) and
    `agent` (agent rollouts, `agent_config`) are None when off; `epochs` (passes over the run's
    data) replaces `steps` when set; `trajectory_ids` pins the run's data (else its data window)."""

    steps: int = 4
    batch_size: int = 32
    seed: int = 0
    epochs: float | None = None
    rl: RLConfig = field(default_factory=RLConfig)
    group: dict[str, int] | None = None
    agent: dict[str, Any] | None = None
    # Replay rollouts (training/runs/replay.py, ReplayConfig): this share of the group rollouts'
    # prompts cut from the corpus's training lines; needs `group`. None: off.
    replay: dict[str, Any] | None = None
    max_samples: int = 4096  # the newest rewarded trajectories a run reads
    trajectory_ids: tuple[int, ...] | None = None
    # What the run trains: every weight ("full", the default) or a LoRA adapter over the frozen base.
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    # The compute precision (training.rl.config.PRECISIONS): "fp32", "bf16" or "auto".
    precision: str = "fp32"

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise SettingsInvalid(problems)
        # Completed by their own checks (agent_config fills in its defaults): one form stored.
        object.__setattr__(self, "group", group_config(self.group))
        object.__setattr__(self, "agent", agent_config(self.agent))
        replay = ReplayConfig.from_dict(self.replay)
        object.__setattr__(self, "replay", replay.to_dict() if replay else None)
        if self.epochs is not None:
            object.__setattr__(self, "epochs", float(self.epochs))

    def problems(self) -> list[str]:
        return [message for _, message in self._problems()]

    def _problems(self) -> list[tuple[str, str]]:
        return _run_problems({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def rounds(self) -> int:
        """Group rollout rounds (1 without group rollouts)."""
        return int((self.group or {}).get("rounds", 1))

    def to_dict(self, only_changed: bool = False) -> dict[str, Any]:
        """JSON. `only_changed`: the settings that differ from the defaults (a beat entry keeps
        only those, so its runs follow the library's defaults for the rest)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rl"] = self.rl.to_dict()
        out["adapter"] = self.adapter.to_dict()
        if self.trajectory_ids is not None:
            out["trajectory_ids"] = list(self.trajectory_ids)
        if not only_changed:
            return out
        default = RunSettings().to_dict()
        out = {k: v for k, v in out.items() if v != default[k]}
        if "rl" in out:
            out["rl"] = {k: v for k, v in out["rl"].items() if v != default["rl"][k]}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSettings:
        """Settings from JSON (missing keys: the defaults; `rl` may hold overrides only). Raises
        SettingsInvalid with every problem found."""
        problems = _unknown(data, {f.name for f in fields(cls)})
        kw: dict[str, Any] = {}
        for name, kind in (("steps", int), ("batch_size", int), ("seed", int), ("max_samples", int)):
            if name in data:
                kw[name] = _number(data, name, kind, problems)
        if data.get("epochs") is not None:
            kw["epochs"] = _number(data, "epochs", float, problems)
        kw.update(_parsed(data, problems))
        if problems:  # with the problems of the values that did parse
            failed = {name for name, _ in problems}
            given = {name: value for name, value in kw.items() if name not in failed and value is not None}
            checked = _run_problems({**RunSettings().__dict__, **given}, skip=failed)
            raise SettingsInvalid(sorted(problems + checked, key=lambda p: _ORDER.index(p[0])))
        return cls(**kw)


_ORDER = ["keys", "steps", "batch_size", "seed", "max_samples", "epochs", "rl", "group", "agent", "replay",
          "trajectory_ids", "adapter", "precision"]


def _run_problems(values: Mapping[str, Any], skip: Collection[str] = ()) -> list[tuple[str, str]]:
    epochs = values["epochs"]
    checks = [
        ("steps", values["steps"] >= 1, "steps must be >= 1"),
        ("batch_size", values["batch_size"] >= 1, "batch_size must be >= 1"),
        ("max_samples", values["max_samples"] >= 1, "max_samples must be >= 1"),
        ("epochs", epochs is None or 0 < epochs <= 16, f"epochs must be in (0, 16], got {epochs!r}"),
        ("rl", isinstance(values["rl"], RLConfig), "rl must be an RLConfig"),
        ("adapter", isinstance(values["adapter"], AdapterConfig), "adapter must be an AdapterConfig"),
        ("precision", values["precision"] in PRECISIONS,
         f"precision must be one of {list(PRECISIONS)}, got {values['precision']!r}"),
    ]
    out = [(name, message) for name, ok, message in checks if not ok and name not in skip]
    for name, check in (("group", group_config), ("agent", agent_config), ("replay", ReplayConfig.from_dict)):
        try:
            if name not in skip:
                check(values[name])
        except (TypeError, ValueError) as exc:
            out.append((name, str(exc)))
    if values.get("replay") and not values.get("group") and "replay" not in skip:
        out.append(("replay", "replay rollouts need group rollouts (how many prompts per round, G completions each)"))
    return out


def _parsed(data: Mapping[str, Any], problems: list[tuple[str, str]]) -> dict[str, Any]:
    """The structured settings (rl, group, agent, trajectory ids, adapter), each checked by its own home."""
    kw: dict[str, Any] = {}
    if data.get("rl") is not None:
        try:
            kw["rl"] = RLConfig.from_dict(dict(data["rl"]))
        except (TypeError, ValueError) as exc:
            problems.append(("rl", f"invalid RL overrides: {exc}"))
    for name, check in (("group", group_config), ("agent", agent_config)):
        try:
            kw[name] = check(data.get(name))
        except ValueError as exc:
            problems.append((name, str(exc)))
    try:
        replay = ReplayConfig.from_dict(data.get("replay"))
        kw["replay"] = replay.to_dict() if replay else None
    except (TypeError, ValueError) as exc:
        problems.append(("replay", str(exc)))
    if "adapter" in data:
        try:
            kw["adapter"] = AdapterConfig.from_value(data["adapter"])
        except (TypeError, ValueError) as exc:
            problems.append(("adapter", str(exc)))
    if "precision" in data:
        try:
            kw["precision"] = precision_value(data["precision"])
        except ValueError as exc:
            problems.append(("precision", str(exc)))
    ids = data.get("trajectory_ids")
    if ids is not None:
        if isinstance(ids, list | tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            kw["trajectory_ids"] = tuple(ids)
        else:
            problems.append(("trajectory_ids", f"trajectory_ids must be a list of integers, got {ids!r}"))
    return kw


@dataclass(frozen=True)
class Schedule:
    """When the beat starts a run for a project (`training.runs.services.train_maybe`): once
    `min_new` rewarded trajectories arrived since the last run, or `every_minutes` after it when
    any did; each run it starts gets `run`."""

    min_new: int = 64
    every_minutes: float = 60.0
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise SettingsInvalid(problems, "schedule")

    def problems(self) -> list[str]:
        return [message for _, message in self._problems()] + self.run.problems()

    def _problems(self) -> list[tuple[str, str]]:
        checks = [("min_new", self.min_new >= 1, "min_new must be >= 1"),
                  ("every_minutes", self.every_minutes >= 0, "every_minutes must be >= 0")]
        return [(name, message) for name, ok, message in checks if not ok]

    def to_dict(self) -> dict[str, Any]:
        """The train beat entry's kwargs, flat (the wire format of `training.tasks.train_maybe`):
        min_new, every_minutes, and the run settings that differ from the defaults."""
        return {"min_new": self.min_new, "every_minutes": self.every_minutes, **self.run.to_dict(only_changed=True)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        problems: list[tuple[str, str]] = []
        kw: dict[str, Any] = {}
        for name, kind in (("min_new", int), ("every_minutes", float)):
            if name in data:
                kw[name] = _number(data, name, kind, problems)
        if problems:
            raise SettingsInvalid(problems, "schedule")
        run = RunSettings.from_dict({k: v for k, v in data.items() if k not in ("min_new", "every_minutes")})
        return cls(**kw, run=run)


# Named recipes. "demo": the demo's learning settings, measured with bench/learning_curve.py (the
# measurements behind each value: docs/learning.md, "The demo's recipe"). Group rollouts of 64 of
# the users' prompts x 8 for 8 rounds, lr 2e-3 (a tiny policy), one pass over each run's data, and
# a trust region to production inside the gate's KL and length bounds.
PRESETS: dict[str, Schedule] = {
    "demo": Schedule(
        min_new=100, every_minutes=1,
        run=RunSettings(
            steps=8, batch_size=64, epochs=1, group={"prompts": 64, "G": 8, "max_tokens": 16, "rounds": 8},
            rl=RLConfig(lr=2e-3, max_staleness=8, micro_batch_size=64, kl_to="production", kl_stop=2.5,
                        length_stop=1.6),
        ),
    ),
}
