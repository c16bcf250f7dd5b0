"""One training run, top to bottom: the base weights, the rewarded trajectories as Samples,
`rl_step` N times (each step's metrics handed to `on_step`), the candidate saved to a folder.

Django-aware (it reads trajectories); the maths is in `training.rl`. Called by
`training.runs.services.train_policy`, which owns the run's state and records what this returns.

    .venv/bin/python manage.py train_now --project SLUG --steps 4
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from django.db.models import Prefetch, QuerySet
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from core.errors import Conflict
from feedback.models import Step, Trajectory
from feedback.selectors import trainable
from feedback.services import quarantine_record
from inference.engines import SamplingParams, make_engine
from training.corpora.config import ReplayConfig
from training.gate.config import SuiteSpec
from training.gate.services import eval_suite_active
from training.gate.stats import kl_estimate
from training.models import PolicyVersion, Reward, RewardSpec, TrainingRun
from training.replicas.background import ReplicaSampler
from training.rewards.agents import run_agent_rollouts
from training.rewards.reward_model import CONTEXT_MIN_LABELS, Labelled, UsersModel, fit_users_model
from training.rewards.selectors import agent_tasks, labelled_suggestions, rewarded_trajectories_since
from training.rewards.services import agent_reward_of, suggestions_reward
from training.rl.advantages import RunningBaseline
from training.rl.config import AdapterConfig, RLConfig
from training.rl.lora import AdapterMismatch, lora_attach, merged_state_dict
from training.rl.loss import k3
from training.rl.precision import resolve_precision, serving_dtype
from training.rl.trainer import Batch, Sample, chunked_logprobs, filter_stale, pi_old, prepare_batch
from training.runs.replay import ReplayRollouts, replay_prompt_count, with_replay
from training.runs.selectors import training_run_last
from training.runs.settings import RunSettings
from training.runs.trust_region import TrustRegion
from training.runs.turns import BadSample, ModelLimits, prompt_token_ids, samples_from
from training.runs.updates import StepCallback, Updates, make_updates, save_candidate
from training.versions.selectors import policy_get, policy_production
from training.versions.services import policy_adapter_folder, policy_folder

SUITE_PROMPTS = 64  # eval-suite prompts (x2 samples) per round for the trust region's KL, as the gate measures it
REFERENCE_N = 2  # completions per prompt from the trust region's reference, for its length
# (step, the steps the run plans, that step's metrics); the plan is known once the data is


@dataclass
class RunData:
    """A run's training data before its group rollouts: the rewarded trajectories' turns and the
    agent rollouts' turns, with what is known of their behaviour log-probs."""

    base_dir: Path  # the base version's folder
    pad_id: int
    samples: list[Sample]
    rewards: list[Reward]  # the Reward rows the trajectories' samples came from
    recorded: list[Sample]  # the samples whose mu came as served (not recomputed)
    unknown_mu: int  # samples whose mu is taken as pi_old (their version has no checkpoint)
    agent_report: dict[str, Any]


def run(run: TrainingRun, folder: Path, on_step: StepCallback) -> dict[str, Any]:
    """Trains and saves the candidate into `folder`; returns the run's result."""
    settings = RunSettings.from_dict(run.settings)
    torch.manual_seed(settings.seed)
    base_dir = policy_folder(run.base_version)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = setup_policy(run.base_version, settings.adapter)
    data = setup_data(run, settings, model, base_dir, tokenizer)
    rollouts, not_sampled = GroupRollouts.setup(run, settings, base_dir, data.rewards, tokenizer)
    rollouts = with_replay(rollouts, ReplayRollouts.setup(run, settings, base_dir))  # prompts cut from the corpus
    try:
        report = train(run, settings, model, data, rollouts, on_step)
    finally:
        if rollouts:
            rollouts.close()
    precision = resolve_precision(settings.precision)  # what "auto" picked here: the result says
    save_candidate(model, base_dir, folder, precision)
    return {**report, **(rollouts.report() if rollouts else not_sampled), **data.agent_report, "precision": precision,
            # popped by training_run_finish into the run's lineage (training.lineage), not the result
            "trained_on": sorted({r.trajectory_id for r in data.rewards} | set(rollouts.learned_from if rollouts else ()))}


def setup_data(run: TrainingRun, settings: RunSettings, model: PreTrainedModel, base_dir: Path, tokenizer: Any
               ) -> RunData:
    pad_id = _pad_id(tokenizer)
    limits = ModelLimits.of(model)
    samples, rewards = setup_samples(run, settings, tokenizer, limits)
    agent, agent_report = agent_samples(run, settings, base_dir, tokenizer, limits)
    samples += agent
    if not samples and not settings.replay:
        raise ValueError("nothing to train on: no rewarded trajectory and no agent rollout with an assistant turn")
    recorded = [s for s in samples if s.behaviour_logprobs is not None]  # mu as served, not recomputed
    unknown_mu = fill_behaviour_logprobs(run, samples, model, settings.rl, pad_id)
    return RunData(base_dir, pad_id, samples, rewards, recorded, unknown_mu, agent_report)


def train(run: TrainingRun, settings: RunSettings, model: PreTrainedModel, data: RunData,
          rollouts: GroupRollouts | None, on_step: StepCallback) -> dict[str, Any]:
    """Round 0 (the data and the first group rollouts), then the later rounds inside the trust
    region; `model` ends at the candidate's weights. Returns what the run reports of it."""
    cfg, base, pad_id = settings.rl, run.base_version.number, data.pad_id
    first = rollouts.round(0) if rollouts else []
    samples = data.samples + first
    baseline = setup_baseline(run, cfg)
    batch = prepare_batch(samples, base, cfg, pad_id, baseline)
    kept, _ = filter_stale(samples, base, cfg.max_staleness)  # the batch's rows, in order
    # pi_old is the pre-update policy for every step of the round (PPO's clip is against it).
    here = {id(s) for s in first}  # sampled by this run's engine from the weights it starts from
    batch.old_logprobs = pi_old(model, batch, [id(s) in here for s in kept], cfg)
    fresh = fresh_mismatch_kl(batch, kept, data.recorded, base)
    measure_kl = cfg.beta > 0 or cfg.kl_stop is not None or cfg.length_stop is not None
    ref_dir = kl_reference(run, cfg, data.base_dir) if measure_kl else None
    ref_model = setup_model(ref_dir).eval() if ref_dir else None
    plan = planned_steps(settings, batch.size, len(first), rollouts)
    updates = make_updates(model, ref_model, ref_dir, settings, plan, on_step, data.base_dir, run.pk)
    region = TrustRegion(cfg.kl_stop, cfg.length_stop)
    if rollouts and cfg.kl_stop is not None and cfg.kl_to == "production":
        rollouts.use_suite()
    # the last weights measured inside (the base's to begin); only later rounds are measured
    inside = _snapshot(model) if region.on and rollouts and rollouts.rounds > 1 else None
    try:
        updates.take(batch, updates.first_steps, settings.seed)
        if rollouts:
            later_rounds(rollouts, model, ref_model, region, inside, updates, pad_id)
    finally:
        updates.close()
    return {"baseline": baseline.state_dict(), "samples": len(samples), "dropped_stale": batch.dropped_stale,
            "behaviour_unknown": data.unknown_mu, "retokenised": sum(s.retokenised for s in samples),
            "trajectories": len({s.episode for s in samples if s.episode}), "steps": updates.done,
            **region.report(), **fresh}


def later_rounds(rollouts: GroupRollouts, model: PreTrainedModel, ref_model: PreTrainedModel | None,
                 region: TrustRegion, inside: dict[str, torch.Tensor] | None, updates: Updates, pad_id: int) -> None:
    """Rounds 1.. of group rollouts, each sampled from the weights the rounds before reached and
    measured against the trust region before it trains; a round measured outside ends the run at
    the last weights measured inside."""
    cfg, base = updates.cfg, rollouts.run.base_version.number
    for r in range(1, rollouts.rounds):
        more = rollouts.round(r, model)
        if not more:
            break
        round_batch = prepare_batch(more, base, cfg, pad_id, None)
        round_batch.old_logprobs = pi_old(model, round_batch, [True] * round_batch.size, cfg)
        if ref_model is not None:  # where the weights that sampled round r are, before it trains
            on_suite = rollouts.suite_kl(r, ref_model)
            region.measure(r, kl=on_suite if on_suite is not None else _kl_to(ref_model, round_batch, cfg),
                           length_ratio=rollouts.length_ratio(r, ref_model) if cfg.length_stop else None)
        if region.left(r):  # back to the last weights measured inside: the candidate
            assert inside is not None
            model.load_state_dict(inside)
            return
        if region.on:
            inside = _snapshot(model)
        updates.take(round_batch, max(1, math.ceil(round_batch.size / updates.size)), updates.seed + r)


def planned_steps(settings: RunSettings, rows: int, first_round: int, rollouts: GroupRollouts | None
                  ) -> tuple[int, int]:
    """(round 0's steps, all the run's steps): `epochs` passes over round 0's rows instead of
    `steps` when set (a run's data varies), and a pass per later round (progress on the runs page)."""
    steps = max(1, math.ceil(settings.epochs * rows / settings.batch_size)) if settings.epochs else settings.steps
    later = (rollouts.rounds - 1) * max(1, math.ceil(first_round / settings.batch_size)) if rollouts else 0
    return steps, steps + later


def kl_reference(run: TrainingRun, cfg: RLConfig, base_dir: Path) -> Path:
    """The weights the KL term (`rl.beta`) holds the update near: the run's base, or with
    `rl.kl_to = "production"` the version in production when the run starts. The gate bounds a
    candidate's KL to production; a training lineage several runs ahead of it drifts past that
    bound (measured: a 10-minute demo's v5-v7 at 4.0-7.1 nats against a budget of 4, each refused)."""
    if cfg.kl_to == "production":
        production = policy_production(run.project)
        if production is not None:
            return policy_folder(production)
    return base_dir


def setup_model(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()


def setup_policy(version: PolicyVersion, adapter: AdapterConfig) -> PreTrainedModel:
    """The weights a run trains, computing exactly `version`'s policy: all of them ("full"), or a
    LoRA adapter over the frozen weights of its named base: `version` itself when it is full
    weights (a fresh adapter, B = 0), or `version`'s own base when it is an adapter (which the run
    goes on training: every version of the lineage stays an adapter over one stored base)."""
    if not adapter.lora:
        return setup_model(policy_folder(version))
    if version.adapter_base is None:
        return lora_attach(setup_model(policy_folder(version)), adapter)
    try:
        return lora_attach(setup_model(policy_folder(version.adapter_base)), adapter, policy_adapter_folder(version))
    except AdapterMismatch as exc:
        raise ValueError(f"v{version.number}: {exc}") from exc


def setup_baseline(run: TrainingRun, cfg: RLConfig) -> RunningBaseline:
    """The running baseline per task bucket carries over from the project's last successful run."""
    previous = training_run_last(run.project)
    state = previous.result.get("baseline") if previous is not None else None
    return RunningBaseline.from_state_dict(state) if state else RunningBaseline(cfg.baseline_decay)


def _rewards_of(run: TrainingRun, settings: RunSettings) -> QuerySet[Reward]:
    spec = _spec(run)
    if settings.trajectory_ids is not None:
        rewards = Reward.objects.filter(spec=spec, trajectory_id__in=settings.trajectory_ids)
        return trainable(rewards, "trajectory").order_by("trajectory_id")
    return rewarded_trajectories_since(run.project, spec, run.data_since, run.data_until)


def _spec(run: TrainingRun) -> RewardSpec:
    if run.spec_id is None:
        raise ValueError(f"run {run.pk} has no reward spec (it was deleted); start a new run")
    return RewardSpec.objects.get(pk=run.spec_id)


def setup_samples(run: TrainingRun, settings: RunSettings, tokenizer: Any, limits: ModelLimits | None = None
                  ) -> tuple[list[Sample], list[Reward]]:
    """The run's rewarded trajectories as Samples (and the Reward rows they came from); one the
    model cannot take is quarantined (kind "training") instead of failing the run. None is an
    error unless the run has agent rollouts (their own data)."""
    limit = settings.max_samples
    rewards = _rewards_of(run, settings).select_related("trajectory").prefetch_related(
        Prefetch("trajectory__steps", queryset=Step.objects.order_by("index"))
    )
    rewards = list(rewards)[-limit:]  # the newest `limit`
    samples, kept = [], []
    for r in rewards:
        try:
            turns = samples_from(r.trajectory, r.total, tokenizer, limits)  # every assistant turn
        except BadSample as exc:
            quarantine_record(run.project_id, "training", f"trajectory {r.trajectory.external_id}", str(exc),
                              trajectory_id=r.trajectory_id, detail={"run": run.pk})
            continue
        samples += turns
        kept.append(r)
    if not samples and not settings.agent and not settings.replay:  # rollouts of its own: clicks optional
        raise ValueError(f"no rewarded trajectories with an assistant turn to train on ({len(rewards)} rewarded)")
    return samples, kept


# --------------------------------------------------------------------------------- agent rollouts


def agent_samples(run: TrainingRun, settings: RunSettings, base_dir: Path, tokenizer: Any, limits: ModelLimits
                  ) -> tuple[list[Sample], dict[str, Any]]:
    """With `agent` in the run settings: G rollouts of `agent.tasks` of the project's agent tasks (a
    slice that moves with the run id) played with the run's base weights through the torch engine
    (training.rewards.agents), rewarded by the tests and the spec's judge (`agent_reward_of`).
    Every assistant turn is a Sample (turns.samples_from, in the context it was sampled in) with
    its reward-to-go; the G rollouts of a task share a group (group-relative advantages). Nothing
    is stored: the rollouts are this run's data, not trajectories for later runs."""
    agent = settings.agent
    if not agent:
        return [], {}
    tasks = agent_tasks(run.project)
    if not tasks:
        raise ValueError(f"the run asks for agent rollouts but project {run.project.slug!r} has no agent tasks; "
                         "register some with manage.py agent_tasks --project SLUG --add DIR")
    n = min(int(agent["tasks"]), len(tasks))
    start = (run.pk * n) % len(tasks)
    chosen = [tasks[(start + i) % len(tasks)] for i in range(n)]
    seed = settings.seed * 1_000_003 + run.pk
    positions = limits.max_positions or 4096
    reward = agent_reward_of(_spec(run), agent.get("tests_weight", 1.0))
    engine = make_engine("torch", base_dir, version=run.base_version.number, seed=seed, max_model_len=positions)
    try:
        events = run_agent_rollouts(engine, chosen, int(agent["G"]), max_turns=int(agent["max_turns"]),
                                    max_tokens=int(agent["max_tokens"]), seed=seed, reward=reward,
                                    summary_budget=min(int(agent["summary_budget"]), positions))
    finally:
        engine.close()
    samples, dropped = [], 0
    for event in events:
        trajectory, steps = _unsaved(run, event)
        try:
            turns = samples_from(trajectory, 0.0, tokenizer, limits, steps=steps)  # the outcome is a step reward
        except BadSample:
            dropped += 1
            continue
        for s in turns:
            s.episode = event["id"]
        samples += turns
    stats = [e["agent"] for e in events]
    return samples, {
        "agent_tasks": [t.name for t in chosen], "agent_rollouts": len(events), "agent_samples": len(samples),
        "agent_dropped": dropped, "agent_reward_mean": round(sum(a["reward"] for a in stats) / len(stats), 4),
        "agent_tests_pass_mean": round(sum(a["tests_share"] for a in stats) / len(stats), 4),
        "agent_turns": sum(a["turns"] for a in stats), "agent_tool_calls": sum(a["tool_calls"] for a in stats),
        "agent_summaries": sum(a["summaries"] for a in stats),
    }


STEP_FIELDS = ("role", "content", "tool_calls", "token_ids", "logprobs", "reward")


def _unsaved(run: TrainingRun, event: dict[str, Any]) -> tuple[Trajectory, list[Step]]:
    """A rollout event as unsaved rows, as feedback_ingest would store it (other keys in extra)."""
    trajectory = Trajectory(project_id=run.project_id, external_id=event["id"], policy_version=event["policy_version"],
                            source="simulated", task=event["task"], prompt=event["prompt"],
                            extra={"group": event["group"], "agent": event["agent"]})
    steps = [Step(index=i, **{k: raw.get(k) for k in STEP_FIELDS if k != "content"}, content=raw.get("content", ""),
                  extra={k: v for k, v in raw.items() if k not in STEP_FIELDS})
             for i, raw in enumerate(event["steps"])]
    return trajectory, steps


# --------------------------------------------------------------------------------- group rollouts


class GroupRollouts:
    """More signal per prompt: for `group.prompts` distinct prompts the users sent in this run's
    data (newest first; a fresh slice of them each round), G completions per round through the torch engine (the serving
    engine's twin: same sampling, bitwise log-probs), each rewarded on the spec's scale by
    `suggestions_reward` — checks and judge as for any trajectory, the users' click in expectation
    from a reward model fitted to every accept/reject so far. Trained on group-relative advantages
    (a prompt's G completions against each other), next to the live samples.

    Round 0 samples the base weights; round r > 0 samples the weights the run has reached (the
    engine is handed the model's state dict), so every round is on-policy.

    `setup` returns None (and a report saying why) when off (`group` unset in the run settings) or
    without a model yet (too few clicks)."""

    def __init__(self, run: TrainingRun, spec: RewardSpec, model: UsersModel, prompts: dict[tuple[int, ...], str],
                 base_dir: Path, settings: RunSettings) -> None:
        self.run, self.spec, self.reward_model, self.prompts = run, spec, model, prompts
        self.keys = list(prompts)
        group = settings.group or {}
        # of a round's group.prompts, those not cut from the corpus (replay rollouts) are the users'
        self.G, self.rounds = int(group["G"]), settings.rounds
        self.per_round = int(group["prompts"]) - replay_prompt_count(group, ReplayConfig.from_dict(settings.replay))
        self.max_tokens = int(group.get("max_tokens", 16))
        self.seed = settings.seed * 1_000_003 + run.pk
        # The sampler's own log-probs (no scoring forward): they are this round's pi_old and mu.
        self.engine = make_engine("torch", base_dir, version=run.base_version.number, seed=self.seed, exact=False,
                                  dtype=serving_dtype(settings.precision))  # a bf16 run samples what it serves
        # The project's replicas with background rollouts on sample the rounds first (this engine
        # what they give back): training.replicas.background.
        self.replicas = ReplicaSampler.setup(run.project_id, self.engine)
        self.rewards_per_round: list[float] = []
        self.mean_tokens: dict[int, float] = {}
        self.suite: SuiteSpec | None = None
        self.kl_on = "samples"
        self.holds_reference = False
        self.count = 0
        self.learned_from: list[int] = []  # trajectories the reward model was fitted on

    @classmethod
    def setup(cls, run: TrainingRun, settings: RunSettings, base_dir: Path, rewards: Sequence[Reward],
              tokenizer: Any) -> tuple[GroupRollouts | None, dict[str, Any]]:
        group = settings.group or {}
        users = int(group.get("prompts", 0)) - replay_prompt_count(group, ReplayConfig.from_dict(settings.replay))
        if users < 1 or int(group.get("G", 0)) < 2:  # none left to the users' prompts: all replay
            return None, {}
        spec = _spec(run)
        labelled = labelled_suggestions(run.project, spec)
        model = users_model(labelled, spec, base_dir, tokenizer)
        if model is None:
            return None, {"reward_model": None, "rollouts": 0}
        prompts: dict[tuple[int, ...], str] = {}
        for reward in reversed(rewards):
            trajectory = reward.trajectory
            if trajectory.source != "live" or len(prompts) >= int(group["prompts"]) * int(group.get("rounds", 1)):
                continue
            step = next((s for s in trajectory.steps.all() if s.role == "assistant" and s.token_ids), None)
            try:
                ids = tuple(prompt_token_ids(trajectory, tokenizer, step))
            except BadSample:
                continue  # quarantined by setup_samples
            messages = trajectory.prompt or []
            if ids and messages:
                prompts.setdefault(ids, str(messages[-1].get("content", "")))
        if not prompts:
            return None, {"reward_model": model.summary(), "rollouts": 0}
        rollouts = cls(run, spec, model, prompts, base_dir, settings)
        rollouts.learned_from = [item.source_id for item in labelled if item.source_id is not None]
        return rollouts, {}

    def round(self, r: int, weights: PreTrainedModel | None = None) -> list[Sample]:
        """Round r's G completions per prompt, scored; from `weights` when given (else the base)."""
        if weights is not None:
            self.engine.load_weights(merged_state_dict(weights), self.run.base_version.number)
        self.holds_reference = False
        seed = self.seed + 7919 * r
        keys = self.round_prompts(r)
        every = self._sample(r, keys, SamplingParams(max_tokens=self.max_tokens, seed=seed))
        self.mean_tokens[r] = sum(len(c.token_ids) for c in every) / max(1, len(every))
        completions = [c for c in every if c.token_ids]
        scored = suggestions_reward(self.spec, [(self.prompts[keys[c.prompt_index]], c.text, c.token_ids,
                                                 keys[c.prompt_index]) for c in completions], self.reward_model)
        self.count += len(completions)
        if scored:
            self.rewards_per_round.append(sum(t for t, _ in scored) / len(scored))
        return [
            Sample(prompt_ids=list(keys[c.prompt_index]), completion_ids=list(c.token_ids), reward=total,
                   behaviour_logprobs=list(c.logprobs), policy_version=self.run.base_version.number,
                   group=f"rollout-{self.run.pk}-{r}-{c.prompt_index}", task="rollout")
            for c, (total, _) in zip(completions, scored, strict=True)
        ]

    def _sample(self, r: int, keys: list[tuple[int, ...]], sampling: SamplingParams) -> list[Any]:
        """Round r's G completions per prompt from the engine's weights (the round's): on the
        replicas taking background rollouts, pushed as this round's weights, else here."""
        prompts = [list(k) for k in keys]
        if self.replicas is None:
            return self.engine.generate(prompts, n=self.G, sampling=sampling)
        return self.replicas.generate(prompts, self.G, sampling, weights=f"run-{self.run.pk}-round-{r}",
                                      state=self.engine.model.state_dict(), version=self.run.base_version.number)

    def length_ratio(self, r: int, reference: PreTrainedModel) -> float:
        """Round r's mean completion length over the reference's on round r's prompts (tokens,
        empties included, as the gate's length_drift): `REFERENCE_N` completions per prompt from
        `reference` with round r's seed. Leaves the reference's weights in the engine (the next
        round loads its own)."""
        self._hold(reference)
        keys = self.round_prompts(r)
        ref = self.engine.generate([list(k) for k in keys], n=min(self.G, REFERENCE_N),
                                   sampling=SamplingParams(max_tokens=self.max_tokens, seed=self.seed + 7919 * r))
        base = sum(len(c.token_ids) for c in ref) / max(1, len(ref))
        ours = self.mean_tokens[r]
        return ours / base if base > 0 else (1.0 if ours <= 0 else float("inf"))

    def _hold(self, reference: PreTrainedModel) -> None:
        """The reference's weights into the engine, once per round (the round's own are loaded by
        `round`)."""
        if not self.holds_reference:
            self.engine.load_weights(merged_state_dict(reference), self.run.base_version.number)
            self.holds_reference = True

    def use_suite(self) -> SuiteSpec | None:
        """The project's eval suite, for the region's KL (None: the project has none)."""
        try:
            self.suite = eval_suite_active(self.run.project).as_spec()
        except Conflict:
            self.suite = None
        return self.suite

    def suite_kl(self, r: int, reference: PreTrainedModel) -> float | None:
        """KL(pi_theta || reference) as the gate measures it: the engine's weights (round r's)
        sample `SUITE_PROMPTS` of the eval suite's prompts with the suite's sampling, the reference
        scores those tokens, token-mean k3 (`stats.kl_estimate`). On the users' own prompts the
        same estimator ran 2-4x above the gate's (3.29 vs 1.31, 5.87 vs 1.47 on a population whose
        code the suite does not hold), so a stop on it ended runs the gate would have admitted.
        Leaves the reference's weights in the engine."""
        spec = self.suite
        if spec is None:
            return None
        start = (r * SUITE_PROMPTS) % len(spec.prompts)
        texts = [spec.prompts[(start + i) % len(spec.prompts)].prompt for i in range(min(SUITE_PROMPTS, len(spec.prompts)))]
        sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed + r)
        ours = [c for c in self.engine.generate(texts, n=2, sampling=sampling) if c.token_ids]
        if not ours:
            return None
        self._hold(reference)
        theirs = [lp for lp, _ in self.engine.score_many([(c.prompt_token_ids, c.token_ids) for c in ours], sampling)]
        self.kl_on = "suite"
        return kl_estimate([list(c.logprobs) for c in ours], theirs)

    def round_prompts(self, r: int) -> list[tuple[int, ...]]:
        """Round r's `group.prompts` prompts: the next slice of the users' newest distinct prompts
        (wrapping round when there are fewer than prompts x rounds). Fresh prompts each round: on
        the same 64 prompts eight rounds raised the rollouts' reward 0.41 -> 0.56 while the
        gate's held-out reward did not move (-0.004)."""
        n = len(self.keys)
        start = (r * self.per_round) % n
        return [self.keys[(start + i) % n] for i in range(min(self.per_round, n))]

    def report(self) -> dict[str, Any]:
        return {"reward_model": self.reward_model.summary(), "rollouts": self.count, "kl_measured_on": self.kl_on,
                "rollout_prompts": len(self.keys),
                "rollout_rounds": len(self.rewards_per_round),
                "rollout_reward_mean": self.rewards_per_round[0] if self.rewards_per_round else None,
                "rollout_reward_by_round": [round(x, 4) for x in self.rewards_per_round],
                **(self.replicas.report() if self.replicas is not None else {})}

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        self.engine.close()


def users_model(labelled: Sequence[Labelled], spec: RewardSpec, base_dir: Path, tokenizer: Any) -> UsersModel | None:
    """The model standing in for the users on the rollouts (training.rewards.reward_model
    `fit_users_model`): from CONTEXT_MIN_LABELS clicks on it may read prompt and completion with a
    frozen copy of the run's base weights (the weights the rollouts start from)."""
    names = [c["name"] for c in spec.checks]
    if sum(i.label is not None for i in labelled) < CONTEXT_MIN_LABELS:
        return fit_users_model(labelled, names)
    frozen = setup_model(base_dir).eval().requires_grad_(False)
    return fit_users_model(labelled, names, frozen, lambda text: tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------- log-probs


def _snapshot(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _kl_to(ref_model: PreTrainedModel, batch: Batch, cfg: RLConfig) -> float:
    """Token-mean k3 KL(pi_theta || pi_ref) over the batch's completion tokens, pi_theta being the
    batch's `old_logprobs` (the weights that sampled it): the gate's estimator."""
    assert batch.old_logprobs is not None
    with torch.no_grad():
        ref = chunked_logprobs(ref_model, batch, cfg)
    mask = batch.completion_mask
    return float(torch.where(mask, k3(ref - batch.old_logprobs), 0.0).sum() / mask.sum().clamp(min=1))


def fill_behaviour_logprobs(
    run: TrainingRun, samples: Sequence[Sample], current: PreTrainedModel, cfg: RLConfig, pad_id: int
) -> int:
    """Recompute missing behaviour log-probs mu from the version that sampled them; returns how
    many samples stay unknown (their version has no checkpoint: mu is taken as pi_old)."""
    by_version: dict[int | None, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.behaviour_logprobs is None and not s.retokenised:  # a re-rendering was never sampled: mu = pi_old
            by_version[s.policy_version].append(s)
    unknown = 0
    for number, group in by_version.items():
        model = _behaviour_model(run, number, current)
        if model is None:
            unknown += len(group)
            continue
        batch = Batch.from_samples(group, pad_id, torch.zeros(len(group)))
        lp = chunked_logprobs(model, batch, cfg)  # (B, T)
        for i, s in enumerate(group):
            start = len(s.prompt_ids)
            s.behaviour_logprobs = lp[i, start : start + len(s.completion_ids)].tolist()
    return unknown


def fresh_mismatch_kl(batch: Batch, rows: Sequence[Sample], recorded: Sequence[Sample], base: int) -> dict[str, Any]:
    """Token-mean k3 KL(mu || pi_old) over the rows served by the base weights themselves with their
    recorded mu: the train/inference agreement invariant (~0 in fp32; a large value is a bug such
    as scoring in the wrong context, not off-policy drift). None when no such row came.

    pi_old (batch.old_logprobs) is the base weights' forward already done for the clip."""
    served = {id(s) for s in recorded}
    fresh = torch.tensor([s.policy_version == base and id(s) in served for s in rows])  # (B,)
    if not bool(fresh.any()):
        return {"fresh_mismatch_kl": None, "fresh_samples": 0}
    mask = batch.behaviour_mask & batch.completion_mask & fresh[:, None]  # (B, T)
    log_ratio = torch.where(mask, batch.behaviour_logprobs - batch.old_logprobs, 0.0)  # log mu - log pi
    kl = k3(-log_ratio)  # (B, T)  KL(mu || pi) estimator under mu: log(pi / mu) at samples of mu
    turns = torch.tensor([s.turn for s in rows])[:, None].expand_as(mask)  # (B, T)
    by_turn = {str(t): float(kl[mask & (turns == t)].mean()) for t in sorted(set(turns[mask].tolist()))}
    return {"fresh_mismatch_kl": float(kl[mask].mean()), "fresh_samples": int(fresh.sum()),
            "fresh_mismatch_kl_by_turn": by_turn}


def _behaviour_model(run: TrainingRun, number: int | None, current: PreTrainedModel) -> PreTrainedModel | None:
    if number == run.base_version.number:
        return current  # still at the base weights: nothing has been trained yet
    version = policy_get(run.project, number)
    if version is None:
        return None
    try:
        return setup_model(policy_folder(version)).eval()
    except Exception:  # noqa: BLE001 - a lost checkpoint degrades to mu = pi_old, it doesn't stop training
        return None


# --------------------------------------------------------------------------------- helpers


def _pad_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0

