"""A training run's trust region: when its group rounds stop (training.runs.job `later_rounds`)."""

from __future__ import annotations

from typing import Any


class TrustRegion:
    """Stops a run's group rounds once the policy has left a region around the KL term's reference
    (`rl.kl_to`; with "production", the region the gate admits): KL past `kl_stop` (the gate's
    `kl_budget`) or mean length outside [1/length_stop, length_stop] times the reference's (the
    gate's `length_drift` bound).

    Round r's samples come from the weights the rounds before it reached. Before round r trains,
    the run measures those weights with the gate's estimators: token-mean k3 KL(pi_theta || pi_ref)
    on a slice of the gate's own suite when the project has one and the reference is production
    (else on the round's samples), and the round's mean completion tokens (empties included)
    against the reference's completions on the same prompts and seeds. A round measured outside is not
    trained on, the run ends there and its weights go back to the last ones measured inside (the
    run's base when round 1 is already outside): that is the candidate. Measured on the demo:
    one round can jump (length ratio 0.67 -> 0.51) and a candidate kept at the measured weights
    was refused for concision and silence. Without the KL stop
    a lineage several runs ahead of production reached 4.0, 6.0 and 7.1 nats against a budget of
    4; without the length stop candidates padded to 3x production's length after their statement
    and were refused for length_drift, run after run, with better held-out accept rates."""

    def __init__(self, kl_stop: float | None, length_stop: float | None = None) -> None:
        self.kl_stop, self.length_stop = kl_stop, length_stop
        self.kl_by_round: dict[int, float] = {}
        self.length_by_round: dict[int, float] = {}
        self.stopped_after: int | None = None
        self.stopped_by: str | None = None

    @property
    def on(self) -> bool:
        return self.kl_stop is not None or self.length_stop is not None

    def measure(self, r: int, kl: float | None = None, length_ratio: float | None = None) -> None:
        if kl is not None:
            self.kl_by_round[r] = kl
        if length_ratio is not None:
            self.length_by_round[r] = length_ratio

    def left(self, r: int) -> bool:
        """True when round r was measured outside the region (the run trains it no more)."""
        kl, ratio = self.kl_by_round.get(r), self.length_by_round.get(r)
        if self.kl_stop is not None and kl is not None and kl > self.kl_stop:
            self.stopped_by = "kl"
        elif self.length_stop is not None and ratio is not None and not (
                1 / self.length_stop <= ratio <= self.length_stop):
            self.stopped_by = "length"
        else:
            return False
        self.stopped_after = r
        return True

    def report(self) -> dict[str, Any]:
        if self.kl_stop is None and self.length_stop is None:
            return {}
        out: dict[str, Any] = {"kl_stop": self.kl_stop,
                               "kl_by_round": {str(r): round(k, 4) for r, k in self.kl_by_round.items()},
                               "stopped_after_round": self.stopped_after, "stopped_by": self.stopped_by}
        if self.length_stop is not None:
            out.update(length_stop=self.length_stop,
                       length_ratio_by_round={str(r): round(x, 4) for r, x in self.length_by_round.items()})
        return out
