"""Reward = feedback signals mapped through the spec + weighted checks + weighted rubric aspects.

Pure computation over plain values; the Django `RewardSpec` row converts with
`RewardSpecData.from_json(row.signal_rewards, row.checks, row.aspects)`.

    .venv/bin/python -m pytest tests/training/test_reward_spec.py -q -p no:django
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.rewards.checks import CheckResult
from training.rewards.judges import AspectScore

# After Cursor Tab: accept +0.75, reject -0.25, silent 0; happy/sad +-1.
DEFAULT_SIGNAL_REWARDS: dict[str, float] = {
    "accept": 0.75,
    "reject": -0.25,
    "silent": 0.0,
    "happy": 1.0,
    "sad": -1.0,
    "edit_kept": 0.5,
    "followup_dissatisfied": -0.5,
}


@dataclass(frozen=True)
class Weighted:
    name: str
    weight: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # check params or an aspect's description


@dataclass(frozen=True)
class RewardSpecData:
    signal_rewards: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SIGNAL_REWARDS))
    checks: tuple[Weighted, ...] = ()
    aspects: tuple[Weighted, ...] = ()

    @classmethod
    def from_json(
        cls,
        signal_rewards: Mapping[str, float] | None = None,
        checks: Sequence[Mapping[str, Any]] = (),
        aspects: Sequence[Mapping[str, Any]] = (),
    ) -> RewardSpecData:
        """Overrides merge over the defaults, so a spec names only what it changes."""
        merged = {**DEFAULT_SIGNAL_REWARDS, **{k: float(v) for k, v in (signal_rewards or {}).items()}}
        return cls(merged, tuple(_weighted(c) for c in checks), tuple(_weighted(a) for a in aspects))

    def to_json(self) -> dict[str, Any]:
        def dump(items: tuple[Weighted, ...]) -> list[dict[str, Any]]:
            return [{"name": w.name, "weight": w.weight, **w.extra} for w in items]

        return {"signal_rewards": dict(self.signal_rewards), "checks": dump(self.checks), "aspects": dump(self.aspects)}


def _weighted(item: Mapping[str, Any]) -> Weighted:
    if "name" not in item:
        raise ValueError(f"a check or aspect needs a 'name': {dict(item)!r}")
    extra = {k: v for k, v in item.items() if k not in ("name", "weight")}
    return Weighted(str(item["name"]), float(item.get("weight", 1.0)), extra)


Signal = str | tuple[str, float | None] | Mapping[str, Any]


def _signal(s: Signal) -> tuple[str, float | None]:
    if isinstance(s, str):
        return s, None
    if isinstance(s, Mapping):
        return str(s["signal"]), s.get("value")
    return str(s[0]), s[1]


def feedback_components(spec: RewardSpecData, signals: Sequence[Signal]) -> dict[str, float]:
    """One component per distinct signal (a repeated click is not a stronger opinion).

    A signal in the map gets its mapped reward; a custom signal gets its numeric `value`;
    a custom signal without a value contributes 0 but still shows in the components.
    No signal at all is the "silent" signal.
    """
    parsed = [_signal(s) for s in signals] or [("silent", None)]
    out: dict[str, float] = {}
    for name, value in parsed:
        if name in spec.signal_rewards:
            out[f"feedback:{name}"] = spec.signal_rewards[name]
        else:
            out[f"feedback:{name}"] = float(value) if value is not None else 0.0
    return out


def compute_reward(
    spec: RewardSpecData,
    feedback_signals: Sequence[Signal],
    check_results: Mapping[str, CheckResult | float],
    aspect_scores: Mapping[str, AspectScore | float | None],
) -> tuple[float, dict[str, float]]:
    """(total, components); total is the sum of the components.

    Every check in the spec must have a result (a missing one is a caller bug). An aspect whose
    judge failed (None / failed score) or did not run is left out, not counted as 0: a broken
    judge must not read as a bad completion.
    """
    components = feedback_components(spec, feedback_signals)
    for check in spec.checks:
        if check.name not in check_results:
            raise ValueError(f"no result for check {check.name!r}; got {sorted(check_results)}")
        result = check_results[check.name]
        score = result.score if isinstance(result, CheckResult) else float(result)
        components[f"check:{check.name}"] = check.weight * score
    for aspect in spec.aspects:
        score = _aspect_value(aspect_scores.get(aspect.name))
        if score is not None:
            components[f"aspect:{aspect.name}"] = aspect.weight * score
    return sum(components.values()), components


def _aspect_value(value: AspectScore | float | None) -> float | None:
    if isinstance(value, AspectScore):
        return value.score
    return None if value is None else float(value)
