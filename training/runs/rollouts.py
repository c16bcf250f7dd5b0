"""Rollouts for training: G samples per prompt from production through the same engine, stored
as simulated trajectories, scored, and trained on group-relative advantages."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.errors import Conflict
from feedback.models import Project, Trajectory
from feedback.selectors import in_project
from feedback.services import feedback_ingest
from inference.engines import SamplingParams, make_engine
from training.models import TrainingRun
from training.replicas.background import ReplicaSampler
from training.rewards.services import reward_spec_current, rewards_compute
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.selectors import policy_production
from training.versions.services import policy_folder


@dataclass(frozen=True)
class RolloutPrompt:
    text: str
    task: str = "rollout"
    check_context: dict[str, Any] | None = None  # e.g. {"tests": "assert add(1, 2) == 3"}

    @classmethod
    def of(cls, item: str | dict[str, Any] | RolloutPrompt) -> RolloutPrompt:
        if isinstance(item, RolloutPrompt):
            return item
        if isinstance(item, str):
            return cls(item)
        return cls(str(item["prompt"]), str(item.get("task", "rollout")), item.get("check_context"))


def _rollout_events(prompts: list[RolloutPrompt], completions: list[Any], G: int, version: int) -> list[dict]:
    batch = uuid.uuid4().hex[:12]
    events = []
    for k, c in enumerate(completions):
        p = prompts[c.prompt_index]
        step = {"role": "assistant", "content": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs}
        if c.routing is not None:
            step["routing"] = c.routing
        events.append({
            "type": "trajectory", "id": f"sim-{batch}-{c.prompt_index}-{k % G}", "policy_version": version,
            "source": "simulated", "task": p.task, "prompt": [{"role": "user", "content": p.text}],
            "steps": [step], "prompt_token_ids": c.prompt_token_ids, "group": f"{batch}-{c.prompt_index}",
            "check_context": p.check_context or {},
        })
    return events


def _sample(project: Project, engine: Any, texts: list[str], G: int, sampling: SamplingParams) -> list[Any]:
    """G completions per prompt from the engine's weights: on the project's replicas taking
    background rollouts when there are any (training.replicas.background; the engine samples what
    they give back), else on the engine. A torch engine's weights can be pushed; another's cannot."""
    replicas = ReplicaSampler.setup(project.pk, engine) if hasattr(engine, "model") else None
    if replicas is None:
        return engine.generate(texts, n=G, sampling=sampling)
    prompts = [engine.encode(t) for t in texts]
    try:
        return replicas.generate(prompts, G, sampling, weights=f"v{engine.version}-{engine.model_dir.name}",
                                 state=engine.model.state_dict(), version=engine.version)
    finally:
        replicas.close()


def rollout_and_train(
    project: Project, prompts: Sequence[str | dict[str, Any] | RolloutPrompt], G: int = 16, *,
    settings: RunSettings | None = None, max_tokens: int = 24, seed: int = 0, engine: Any = None, inline: bool = True,
) -> tuple[TrainingRun, bool]:
    """Samples G completions per prompt from the production policy, records them as simulated
    trajectories (through feedback_ingest), scores them with the current spec's checks and judge,
    and trains on group-relative advantages (inline, or queued for the train workers): a run with
    `settings` (default one step) on exactly those trajectories, all in one batch."""
    settings = settings or RunSettings(steps=1)
    base = policy_production(project)
    if base is None:
        raise Conflict(f"project {project.slug!r} has no production policy", "Run bootstrap_policy first.")
    pool = [RolloutPrompt.of(p) for p in prompts]
    own = engine is None
    engine = engine or make_engine("torch", policy_folder(base), version=base.number, seed=seed)
    try:
        completions = _sample(project, engine, [p.text for p in pool], G, SamplingParams(max_tokens=max_tokens, seed=seed))
    finally:
        if own:
            engine.close()
    events = _rollout_events(pool, completions, G, base.number)
    for start in range(0, len(events), 1000):
        feedback_ingest(project, events[start : start + 1000])
    ids = list(Trajectory.objects.filter(in_project(project), external_id__in=[e["id"] for e in events]).values_list(
        "pk", flat=True))
    rewards_compute(ids, reward_spec_current(project))
    run, created = training_run_start(project, replace(settings, batch_size=len(ids), trajectory_ids=tuple(ids)),
                                      enqueue=not inline)
    if created and inline:
        run = train_policy(run.pk)
    return run, created
