"""What the gate reads and writes: scored samples of a suite (candidate, production, the project's
base) and the report's check rows. Pure Python."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One scored completion."""

    prompt_id: str
    text: str
    tokens: int
    reward: float
    verifiable: float | None = None  # weighted mean of the checks, in [0, 1]
    judge: float | None = None  # mean of the judge's aspects, in [0, 1]
    aspects: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] | None = None  # under the policy that sampled it
    other_logprobs: list[float] | None = None  # same tokens under the other policy
    token_ids: tuple[int, ...] = ()  # the completion's tokens (the users' reward model reads them)
    ref_logprobs: list[float] | None = None  # same tokens under the project's reference (its base)


@dataclass
class SuiteSamples:
    candidate: list[Sample]
    production: list[Sample]
    # The reference's own samples (unscored) when it is not production; None: production is it.
    reference: list[Sample] | None = None
    prompts: dict[str, str] = field(default_factory=dict)  # prompt id -> text
    # prompt id -> what the user was about to type (the suite prompt's context["rest"]), for the
    # prompts cut from real lines: the matched-characters row reads it
    intended: dict[str, str] = field(default_factory=dict)
    # prompt id -> (candidate, base) log-probs of each token of the intended line (its first line),
    # teacher-forced after the prompt: how likely each side finds what people type there
    intended_logprobs: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    @property
    def base(self) -> list[Sample]:
        """The samples the naturalness and collapse rows compare the candidate with."""
        return self.reference if self.reference is not None else self.production


@dataclass(frozen=True)
class CheckRow:
    name: str
    value: float | None
    threshold: float | list[float] | None
    interval: list[float] | None
    passed: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def by_prompt(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        out[s.prompt_id].append(s)
    return out
