"""Replay rollouts: simulated tab-completion requests cut from the project's own code. A training
line of the corpus, cut after a few characters (up to half the line), is a prompt whose right
answer is known: what was actually written. G completions per prompt through the run's torch
engine, each rewarded by the accepted characters against the rest of the real line
(training/rewards/usefulness.py `accepted_chars`, the rule the simulated users apply) over that
rest's length, in [0, 1]; trained on group-relative advantages next to the users' prompts.

The corpus's held-out files are never read here (the gate scores every version on them).

    .venv/bin/python manage.py train_now --project SLUG --group '{"prompts": 32, "G": 8}' \
        --replay '{"share": 0.5}'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.engines import SamplingParams, make_engine
from training.corpora.config import ReplayConfig
from training.corpora.lines import Continuation, continuation_prompts
from training.corpora.selectors import corpus_get, corpus_texts
from training.models import TrainingRun
from training.rewards.usefulness import kept_share
from training.rl.lora import merged_state_dict
from training.rl.precision import serving_dtype
from training.rl.trainer import Sample
from training.runs.settings import RunSettings


def replay_reward(completion: str, rest: str) -> float:
    """The share of the rest of the real line the completion got right (0 below the rule's
    minimum of accepted characters)."""
    return kept_share(completion, rest)


def replay_prompt_count(group: dict[str, Any], replay: ReplayConfig | None) -> int:
    """Of a round's `group.prompts`, how many are cut from the corpus (at least 1 when on)."""
    if replay is None or not group:
        return 0
    return max(1, min(int(group["prompts"]), round(int(group["prompts"]) * float(replay.share))))


class ReplayRollouts:
    """Round r: `per_round` fresh corpus prompts (a new seeded draw each round), G completions each
    from the weights the run has reached, rewarded by `replay_reward`."""

    def __init__(self, run: TrainingRun, texts: list[tuple[str, str]], base_dir: Path, cfg: ReplayConfig,
                 settings: RunSettings) -> None:
        group = settings.group or {}
        self.run, self.texts, self.cfg, self.rounds = run, texts, cfg, settings.rounds
        self.G, self.per_round = int(group["G"]), replay_prompt_count(group, cfg)
        self.max_tokens = int(group.get("max_tokens", 16))
        self.seed = settings.seed * 1_000_003 + run.pk + 17
        self.engine = make_engine("torch", base_dir, version=run.base_version.number, seed=self.seed, exact=False,
                                  dtype=serving_dtype(settings.precision))  # a bf16 run samples what it serves
        self.rewards: list[float] = []
        self.count = 0
        self.files = sorted({path for path, _ in texts})

    @classmethod
    def setup(cls, run: TrainingRun, settings: RunSettings, base_dir: Path) -> ReplayRollouts | None:
        cfg = ReplayConfig.from_dict(settings.replay)
        if cfg is None or not settings.group:
            return None
        texts = corpus_texts(corpus_get(run.project, cfg.corpus), heldout=False)  # never the held-out slice
        return cls(run, texts, base_dir, cfg, settings) if texts else None

    def prompts(self, r: int) -> list[Continuation]:
        return continuation_prompts(self.texts, n=self.per_round, seed=self.seed + 7919 * r, min_prefix=self.cfg.min_prefix)

    def round(self, r: int, weights: Any = None) -> list[Sample]:
        if weights is not None:
            self.engine.load_weights(merged_state_dict(weights), self.run.base_version.number)
        prompts = self.prompts(r)
        completions = [c for c in self.engine.generate([p.prompt for p in prompts], n=self.G, sampling=SamplingParams(
            max_tokens=self.max_tokens, seed=self.seed + 104_729 * r)) if c.token_ids]
        rewards = [replay_reward(c.text, prompts[c.prompt_index].rest) for c in completions]
        self.count += len(completions)
        if rewards:
            self.rewards.append(sum(rewards) / len(rewards))
        return [Sample(prompt_ids=list(c.prompt_token_ids), completion_ids=list(c.token_ids), reward=reward,
                       behaviour_logprobs=list(c.logprobs), policy_version=self.run.base_version.number,
                       group=f"replay-{self.run.pk}-{r}-{c.prompt_index}", task="replay")
                for c, reward in zip(completions, rewards, strict=True)]

    def report(self) -> dict[str, Any]:
        return {"replay_rollouts": self.count, "replay_prompts_per_round": self.per_round,
                "replay_share": self.cfg.share, "replay_files": len(self.files),
                "replay_reward_by_round": [round(x, 4) for x in self.rewards]}

    def close(self) -> None:
        self.engine.close()


class MixedRollouts:
    """A run's group rollouts with replay rollouts beside them, as one sampler for the job's rounds:
    each round is the users' prompts' completions and the corpus's. The trust region's suite KL and
    length ratio are measured on the users' side (the gate's measures); with replay alone, the KL is
    the round's samples' and the length is not measured."""

    def __init__(self, users: Any, replay: ReplayRollouts) -> None:
        self.users, self.replay, self.run = users, replay, replay.run
        self.rounds = max(replay.rounds, users.rounds if users else 1)
        self.learned_from = users.learned_from if users else []

    def round(self, r: int, weights: Any = None) -> list[Sample]:
        return (self.users.round(r, weights) if self.users else []) + self.replay.round(r, weights)

    def use_suite(self) -> Any:
        return self.users.use_suite() if self.users else None

    def suite_kl(self, r: int, reference: Any) -> float | None:
        return self.users.suite_kl(r, reference) if self.users else None

    def length_ratio(self, r: int, reference: Any) -> float | None:
        return self.users.length_ratio(r, reference) if self.users else None

    def report(self) -> dict[str, Any]:
        return {**(self.users.report() if self.users else {}), **self.replay.report()}

    def close(self) -> None:
        for sampler in (self.users, self.replay):
            if sampler is not None:
                sampler.close()


def with_replay(users: Any, replay: ReplayRollouts | None) -> Any:
    """The run's sampler: the users' group rollouts (or None), joined by replay rollouts when on."""
    return MixedRollouts(users, replay) if replay is not None else users
