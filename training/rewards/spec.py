"""Reward = feedback signals mapped through the spec + weighted checks + weighted rubric aspects.

Pure computation over plain values; the Django `RewardSpec` row converts with
`RewardSpecData.from_json(row.signal_rewards, row.checks, row.aspects)`.

Graded signals. A signal's entry in `signal_rewards` is its reward (`"accept": 0.75`) or an object
saying how the event's `value` scales it (feedback.events `GRADED_VALUES` fixes each unit):

- `{"reward": 0.75, "value": "chars", "scale": 40}` for `accept`, whose value is the accepted
  characters of a partial accept: reward x min(value, scale) / scale. Linear up to `scale`
  characters, then saturated: 10 kept characters earn 0.1875, 40 or 400 earn the full 0.75
  (what a user did not have to type is the utility, but one long accept is not worth ten clicks);
- `{"reward": 0.5, "value": "fraction"}` for `edit_kept`, whose value is the kept fraction in
  [0, 1]: reward x value (a quarter kept earns 0.125).

An event without a value earns the full reward (a product that does not measure the grade sends
a plain accept); a value beyond the range is clamped (ingest refuses it before it gets here).

    .venv/bin/python -m pytest tests/training/rewards/test_reward_spec.py -q -p no:django
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from feedback.events import GRADED_VALUES, MAX_ACCEPTED_CHARS
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


GRADE_HELP = ('grade a signal as {"reward": 0.75, "value": "chars", "scale": 40} (accept: accepted characters, '
              'saturating at `scale`) or {"reward": 0.5, "value": "fraction"} (edit_kept: the kept fraction), '
              'or give a plain number')


@dataclass(frozen=True)
class Grade:
    """How a graded signal's `value` scales its reward: `factor(value)` in [0, 1]."""

    unit: str  # "chars" | "fraction"
    scale: float = 1.0  # chars: the accepted characters that earn the full reward

    def factor(self, value: float | None) -> float:
        if value is None:
            return 1.0
        if self.unit == "chars":
            return min(max(float(value), 0.0), self.scale) / self.scale
        return min(max(float(value), 0.0), 1.0)

    def to_json(self, reward: float) -> dict[str, Any]:
        return {"reward": reward, "value": self.unit, **({"scale": self.scale} if self.unit == "chars" else {})}


def _signal_entry(name: str, raw: Any) -> tuple[float, Grade | None]:
    """(full reward, grade or None) of one `signal_rewards` entry; ValueError says the fix."""
    if not isinstance(raw, Mapping):
        return _finite(raw, f"signal_rewards.{name}"), None
    unknown = sorted(set(raw) - {"reward", "value", "scale"})
    if unknown or "reward" not in raw or "value" not in raw:
        raise ValueError(f"signal_rewards.{name}: {dict(raw)!r} is not a graded signal; {GRADE_HELP}")
    unit = GRADED_VALUES.get(name)
    if unit is None:
        raise ValueError(f"signal_rewards.{name} cannot be graded: only {sorted(GRADED_VALUES)} carry a graded value; "
                         f"give {name} a plain number")
    if raw["value"] != unit:
        raise ValueError(f"signal_rewards.{name}.value={raw['value']!r}: a {name}'s value is in {unit!r}; "
                         f"set \"value\": {unit!r}")
    reward = _finite(raw["reward"], f"signal_rewards.{name}.reward")
    if unit == "fraction":
        if "scale" in raw:
            raise ValueError(f"signal_rewards.{name}: a fraction needs no scale; remove \"scale\"")
        return reward, Grade(unit)
    scale = _finite(raw.get("scale"), f"signal_rewards.{name}.scale")
    if not 1 <= scale <= MAX_ACCEPTED_CHARS:
        raise ValueError(f"signal_rewards.{name}.scale={scale:g}: give the accepted characters that earn the full "
                         f"reward, a number in [1, {MAX_ACCEPTED_CHARS}]")
    return reward, Grade(unit, scale)


def _finite(raw: Any, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ValueError(f"{where}={raw!r}: give a finite number")
    return float(raw)


@dataclass(frozen=True)
class Weighted:
    name: str
    weight: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # check params or an aspect's description


@dataclass(frozen=True)
class RewardSpecData:
    signal_rewards: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SIGNAL_REWARDS))  # full rewards
    checks: tuple[Weighted, ...] = ()
    aspects: tuple[Weighted, ...] = ()
    grades: dict[str, Grade] = field(default_factory=dict)  # graded signals' scaling

    @classmethod
    def from_json(
        cls,
        signal_rewards: Mapping[str, Any] | None = None,
        checks: Sequence[Mapping[str, Any]] = (),
        aspects: Sequence[Mapping[str, Any]] = (),
    ) -> RewardSpecData:
        """Overrides merge over the defaults, so a spec names only what it changes."""
        parsed = {str(k): _signal_entry(str(k), v) for k, v in (signal_rewards or {}).items()}
        merged = {**DEFAULT_SIGNAL_REWARDS, **{k: r for k, (r, _) in parsed.items()}}
        grades = {k: g for k, (_, g) in parsed.items() if g is not None}
        return cls(merged, tuple(_weighted(c) for c in checks), tuple(_weighted(a) for a in aspects), grades)

    def signal_reward(self, name: str, value: float | None) -> float:
        """A mapped signal's reward for one event: its full reward, scaled by its grade if graded."""
        grade = self.grades.get(name)
        full = self.signal_rewards[name]
        return full * grade.factor(value) if grade is not None else full

    def signals_json(self) -> dict[str, Any]:
        return {k: self.grades[k].to_json(r) if k in self.grades else r for k, r in self.signal_rewards.items()}

    def to_json(self) -> dict[str, Any]:
        def dump(items: tuple[Weighted, ...]) -> list[dict[str, Any]]:
            return [{"name": w.name, "weight": w.weight, **w.extra} for w in items]

        return {"signal_rewards": self.signals_json(), "checks": dump(self.checks), "aspects": dump(self.aspects)}


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

    A signal in the map gets its mapped reward (scaled by its `value` when the spec grades it; of
    repeated events the last one's value counts); a custom signal gets its numeric `value`;
    a custom signal without a value contributes 0 but still shows in the components.
    No signal at all is the "silent" signal.
    """
    parsed = [_signal(s) for s in signals] or [("silent", None)]
    out: dict[str, float] = {}
    for name, value in parsed:
        if name in spec.signal_rewards:
            out[f"feedback:{name}"] = spec.signal_reward(name, value)
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
