"""Agent trajectories as training samples: every assistant turn of a trajectory is one Sample,
scored in exactly the context it was sampled in; user, tool and system text is context only.

A turn's context is, in order of preference: the prompt token ids the serving process recorded
with that step (`steps[].prompt_token_ids`; the trajectory-level `prompt_token_ids` belongs to
its first step with token ids), else the chat template's rendering of the prompt and the steps
before it. A turn sent without token ids is re-tokenised from its text with the version's chat
template and flagged `retokenised`: it has no behaviour log-probs, so the trainer takes
mu = pi_old for it (importance weight 1: no train/inference correction, PPO's clip still holds
the update near pi_old, the staleness bound still drops old data) and leaves it out of the
mismatch figures. Rewards: `training.rl.advantages.turn_returns` (docs/agents.md).

    .venv/bin/python -m pytest tests/training/runs/test_turns.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jinja2.exceptions import TemplateError
from transformers import PreTrainedModel

from feedback.models import Step, Trajectory
from kernels.routing import moe_routers
from training.rl.advantages import turn_returns
from training.rl.trainer import Sample


@dataclass(frozen=True)
class ModelLimits:
    """What a sample must fit to go through the model's forward (and its router replay)."""

    vocab_size: int
    max_positions: int | None
    moe_layers: int = 0  # 0: a dense model, which takes no routing
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelLimits:
        routers = moe_routers(model)
        first = routers[0] if routers else None
        return cls(vocab_size=int(model.get_input_embeddings().num_embeddings),
                   max_positions=getattr(model.config, "max_position_embeddings", None),
                   moe_layers=len(routers), num_experts=int(first.num_experts) if first else 0,
                   top_k=int(first.top_k) if first else 0)


class BadSample(ValueError):
    """A stored trajectory the model cannot take (ids outside its vocabulary, routing of the wrong
    shape): quarantined, and the run trains on the others."""


def samples_from(trajectory: Trajectory, reward: float, tokenizer: Any, limits: ModelLimits | None = None,
                 steps: list[Step] | None = None) -> list[Sample]:
    """One Sample per assistant turn (steps in index order; prefetch them), its reward the turn's
    reward-to-go. Raises BadSample when any turn does not fit the model (`limits`) or the
    trainer's shapes: the trajectory is then quarantined whole. `steps`: the trajectory's steps
    when it is not stored (a run's own agent rollouts); default, its stored ones."""
    steps = list(steps) if steps is not None else list(trajectory.steps.all())
    turns = [i for i, s in enumerate(steps) if s.role == "assistant" and (s.token_ids or s.content or s.tool_calls)]
    if not turns:
        return []
    first_ids = next((i for i in turns if steps[i].token_ids), None)
    returns = turn_returns(reward, [s.reward for s in steps], turns)
    extra = trajectory.extra if isinstance(trajectory.extra, dict) else {}
    out = []
    for k, (i, ret) in enumerate(zip(turns, returns, strict=True)):
        sample = _turn_sample(trajectory, steps, i, tokenizer, i == first_ids, limits)
        if sample is None:
            continue
        sample.reward, sample.turn = ret, k
        sample.episode, sample.episode_return = f"trajectory-{trajectory.pk}", returns[0]
        sample.group, sample.task = extra.get("group"), trajectory.task or "default"
        out.append(sample)
    return out


def sample_from(trajectory: Trajectory, reward: float, tokenizer: Any, limits: ModelLimits | None = None
                ) -> Sample | None:
    """The first turn with token ids as served (None without one): the single-turn view."""
    return next((s for s in samples_from(trajectory, reward, tokenizer, limits) if not s.retokenised), None)


def _turn_sample(trajectory: Trajectory, steps: list[Step], i: int, tokenizer: Any, first_ids: bool,
                 limits: ModelLimits | None) -> Sample | None:
    step = steps[i]
    if step.token_ids:
        prompt_ids = recorded_context(trajectory, step, first_ids)
        if prompt_ids is None:
            prompt_ids = _encode(tokenizer, render(tokenizer, context_messages(trajectory, steps, i), True))
        completion_ids = _ids(step.token_ids, "token_ids")
        ok = isinstance(step.logprobs, list) and len(step.logprobs) == len(completion_ids)
        logprobs = _logprobs(step.logprobs) if ok and step.logprobs else None
        routing = routing_tensor(step.routing, len(prompt_ids) + len(completion_ids))
        retokenised = False
    else:
        prompt_ids, completion_ids = rendered_turn(tokenizer, context_messages(trajectory, steps, i), step)
        logprobs, routing, retokenised = None, None, True
    if not prompt_ids or not completion_ids:
        return None
    if limits is not None:
        _fits(limits, prompt_ids + completion_ids, routing)
    return Sample(prompt_ids=prompt_ids, completion_ids=completion_ids, behaviour_logprobs=logprobs,
                  policy_version=trajectory.policy_version, routing=routing, retokenised=retokenised)


def recorded_context(trajectory: Trajectory, step: Step, first_ids: bool) -> list[int] | None:
    """The prompt ids the engine was fed for `step`, when recorded (with the step, or with the
    trajectory for its first step with token ids: rollouts record them there)."""
    sources = [step.extra] + ([trajectory.extra] if first_ids else [])
    for extra in sources:
        recorded = extra.get("prompt_token_ids") if isinstance(extra, dict) else None
        if recorded is not None and recorded != []:
            return _ids(recorded, "prompt_token_ids")
    return None


def message_of(step: Step) -> dict[str, Any]:
    """A stored step as a chat message (tool calls and the tool call it answers included)."""
    message: dict[str, Any] = {"role": step.role, "content": step.content}
    if step.tool_calls:
        message["tool_calls"] = step.tool_calls
    extra = step.extra if isinstance(step.extra, dict) else {}
    for key in ("tool_call_id", "name"):
        if isinstance(extra.get(key), str):
            message[key] = extra[key]
    return message


def context_messages(trajectory: Trajectory, steps: list[Step], i: int) -> list[dict[str, Any]]:
    """What turn i saw as messages: the prompt and every step before it; after a summary turn
    (step extra `summary: true`) the summary replaced the turns before it."""
    prompt = [m for m in (trajectory.prompt or []) if isinstance(m, dict)]
    start = next((j for j in range(i - 1, -1, -1) if isinstance(steps[j].extra, dict) and steps[j].extra.get("summary")), 0)
    return prompt + [message_of(s) for s in steps[start:i]]


def render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return "".join(str(m.get("content", "")) for m in messages)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError) as exc:
        raise BadSample(f"the chat template cannot render the trajectory's messages: {exc}") from None


def rendered_turn(tokenizer: Any, context: list[dict[str, Any]], step: Step) -> tuple[list[int], list[int]]:
    """(context ids, turn ids) of a turn sent as text: the template's rendering of the context
    with the generation prompt, and what the rendering of context + turn adds to it."""
    before = render(tokenizer, context, True)
    after = render(tokenizer, [*context, message_of(step)], False)
    if not after.startswith(before):
        raise BadSample("the chat template does not render this assistant turn as a continuation of its "
                        "context; send the turn's token_ids and prompt_token_ids as served")
    return _encode(tokenizer, before), _encode(tokenizer, after[len(before):])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def prompt_token_ids(trajectory: Trajectory, tokenizer: Any, step: Step | None = None) -> list[int]:
    """The ids the engine was fed for the trajectory's first turn with token ids (`step`): as
    recorded, else the chat template's rendering of the prompt.

    Scoring a completion in any other context than the one it was sampled in makes the
    behaviour log-probs meaningless (mismatch KL ~0.7 nats on the same weights)."""
    if step is not None:
        recorded = recorded_context(trajectory, step, True)
        if recorded is not None:
            return recorded
    elif isinstance(trajectory.extra, dict) and trajectory.extra.get("prompt_token_ids"):
        return _ids(trajectory.extra["prompt_token_ids"], "prompt_token_ids")
    return _encode(tokenizer, render(tokenizer, [m for m in (trajectory.prompt or []) if isinstance(m, dict)], True))


def _ids(raw: Any, name: str) -> list[int]:
    if not isinstance(raw, list) or not all(type(t) is int and t >= 0 for t in raw):
        raise BadSample(f"{name} is not a flat list of non-negative integer token ids")
    return list(raw)


def _logprobs(raw: list[Any]) -> list[float] | None:
    ok = all(type(x) in (int, float) and math.isfinite(x) and x <= 1e-6 for x in raw)
    if not ok:
        raise BadSample("logprobs are not finite log-probabilities (numbers <= 0)")
    return [float(x) for x in raw]


def _fits(limits: ModelLimits, ids: list[int], routing: torch.Tensor | None) -> None:
    if max(ids) >= limits.vocab_size:
        raise BadSample(f"token id {max(ids)} is outside the policy's vocabulary of {limits.vocab_size} ids")
    if limits.max_positions is not None and len(ids) > limits.max_positions:
        raise BadSample(f"{len(ids)} tokens are more than the policy's {limits.max_positions} positions")
    if routing is None:
        return
    if limits.moe_layers == 0:
        raise BadSample("routing was recorded but the policy is dense (it has no MoE router to replay)")
    layers, _, k = routing.shape  # (L, T, k)
    if (layers, k) != (limits.moe_layers, limits.top_k):
        raise BadSample(f"routing has {layers} layers of top-{k} experts; the policy has {limits.moe_layers} "
                        f"MoE layers of top-{limits.top_k}")
    if int(routing.min()) < -1 or int(routing.max()) >= limits.num_experts:
        raise BadSample(f"routing names expert ids outside [0, {limits.num_experts})")


def routing_tensor(routing: Any, width: int) -> torch.Tensor | None:
    """Engine routing (positions fed, L, k) -> the trainer's (L, width, k), -1 where unrecorded.
    Raises BadSample for routing that is not a regular (positions, L, k) array of integer ids."""
    if not routing:
        return None
    try:
        recorded = torch.tensor(routing, dtype=torch.long)  # (N, L, k)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise BadSample(f"routing is not a (positions, layers, top-k) array of expert ids: {exc}") from None
    if recorded.dim() != 3 or 0 in recorded.shape:
        raise BadSample(f"routing has shape {tuple(recorded.shape)}; expected (positions, layers, top-k)")
    n = min(recorded.shape[0], width)
    out = torch.full((recorded.shape[1], width, recorded.shape[2]), -1, dtype=torch.long)  # (L, width, k)
    out[:, :n] = recorded[:n].permute(1, 0, 2)
    return out


