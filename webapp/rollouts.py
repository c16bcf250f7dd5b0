"""Reads for the rollouts list and the replay page: filtered trajectories with their signals and
rewards, and one trajectory's steps token by token with its group and the credit of each trained
turn. Like webapp.selectors, a fixed number of queries whatever the row counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet

from core.errors import NotFound
from core.params import query_float, query_int, query_text
from feedback.models import FeedbackEvent, Project, Step, Trajectory
from training.models import PolicyVersion, Reward, RubricScore
from training.rl.advantages import turn_returns
from webapp import charts
from webapp.selectors import PAGE_SIZE


@dataclass
class RolloutFilter:
    task: str = ""
    version: int | None = None
    source: str = ""
    signal: str = ""  # a signal the trajectory got, or "none" for no feedback (silence)
    reward_min: float | None = None
    reward_max: float | None = None

    @classmethod
    def from_query(cls, query: Any) -> RolloutFilter:
        return cls(task=query_text(query, "task"), version=query_int(query, "version", None, 0),
                   source=query_text(query, "source", 64), signal=query_text(query, "signal", 64),
                   reward_min=query_float(query, "reward_min"), reward_max=query_float(query, "reward_max"))

    def apply(self, qs: QuerySet[Trajectory]) -> QuerySet[Trajectory]:
        if self.task:
            qs = qs.filter(task=self.task)
        if self.version is not None:
            qs = qs.filter(policy_version=self.version)
        if self.source:
            qs = qs.filter(source=self.source)
        if self.signal:
            got = FeedbackEvent.objects.filter(trajectory=OuterRef("pk"))
            qs = qs.filter(~Exists(got)) if self.signal == "none" else qs.filter(Exists(got.filter(signal=self.signal)))
        if self.reward_min is not None or self.reward_max is not None:
            rewards = Reward.objects.filter(trajectory=OuterRef("pk"))
            if self.reward_min is not None:
                rewards = rewards.filter(total__gte=self.reward_min)
            if self.reward_max is not None:
                rewards = rewards.filter(total__lte=self.reward_max)
            qs = qs.filter(Exists(rewards))
        return qs

    def query(self) -> str:
        from urllib.parse import urlencode

        pairs = (("task", self.task), ("version", self.version), ("source", self.source), ("signal", self.signal),
                 ("reward_min", self.reward_min), ("reward_max", self.reward_max))
        return urlencode({k: v for k, v in pairs if v not in ("", None)})


def rollout_list(project: Project, flt: RolloutFilter) -> list[Trajectory]:
    """The newest PAGE_SIZE of the filter, each with its prompt, completion, signals and reward."""
    qs = flt.apply(Trajectory.objects.filter(project=project))
    rows = list(qs.order_by("-occurred_at", "-id")
                .only("id", "external_id", "policy_version", "task", "source", "occurred_at", "prompt")
                .prefetch_related(
                    Prefetch("steps", queryset=Step.objects.filter(role="assistant").order_by("index")
                             .only("id", "trajectory_id", "content", "index", "role")),
                    Prefetch("feedback_events", queryset=FeedbackEvent.objects.order_by("occurred_at", "id")
                             .only("id", "trajectory_id", "signal", "occurred_at")),
                    Prefetch("rewards", queryset=Reward.objects.select_related("spec").order_by("-spec__version")))
                [:PAGE_SIZE])
    for t in rows:
        messages = t.prompt if isinstance(t.prompt, list) else []
        t.prompt_text = str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
        t.completion_text = "".join(s.content for s in t.steps.all())
        t.signals = [e.signal for e in t.feedback_events.all()]
        rewards = t.rewards.all()
        t.reward_total = rewards[0].total if rewards else None
    return rows


def _neighbour(project: Project, t: Trajectory, flt: RolloutFilter, older: bool) -> int | None:
    qs = flt.apply(Trajectory.objects.filter(project=project))
    if older:
        qs = qs.filter(Q(occurred_at__lt=t.occurred_at) | Q(occurred_at=t.occurred_at, id__lt=t.id))
        qs = qs.order_by("-occurred_at", "-id")
    else:
        qs = qs.filter(Q(occurred_at__gt=t.occurred_at) | Q(occurred_at=t.occurred_at, id__gt=t.id))
        qs = qs.order_by("occurred_at", "id")
    return qs.values_list("id", flat=True).first()


def _group(project: Project, t: Trajectory) -> list[dict[str, Any]]:
    """Rollouts of the same prompt (same group id, else same prompt within an hour), with rewards."""
    qs = Trajectory.objects.filter(project=project, task=t.task,
                                   occurred_at__range=(t.occurred_at - timedelta(hours=1),
                                                       t.occurred_at + timedelta(hours=1)))
    group = (t.extra or {}).get("group")
    qs = qs.filter(extra__group=group) if group else qs.filter(prompt=t.prompt)
    members = list(qs.order_by("id").prefetch_related(
        Prefetch("steps", queryset=Step.objects.only("trajectory_id", "index", "role", "content", "reward")),
        Prefetch("rewards", queryset=Reward.objects.select_related("spec").order_by("-spec__version")),
    )[:8])
    return [{"t": m, "reward": m.rewards.all()[0].total if m.rewards.all() else None, "return": _return(m),
             "completion": " ".join(s.content for s in m.steps.all() if s.role == "assistant")} for m in members]


def _return(t: Trajectory) -> float | None:
    """The trajectory's return as the trainer compares it in a group: its first turn's reward-to-go."""
    steps, rewards = list(t.steps.all()), list(t.rewards.all())
    first = next((i for i, s in enumerate(steps) if s.role == "assistant"), None)
    if first is None or not rewards:
        return None
    return turn_returns(rewards[0].total, [s.reward for s in steps], [first])[0]


@dataclass
class StepView:
    step: Step
    tokens: list[dict[str, Any]] = field(default_factory=list)
    routing: dict[str, Any] | None = None
    hidden: int = 0  # tokens past REPLAY_MAX_TOKENS, summarised as a count
    total: int = 0
    turn: dict[str, Any] | None = None  # a trained assistant turn: its index, return, advantage


def _turn_credit(t: Trajectory, views: list[StepView], group: list[dict[str, Any]]) -> None:
    """Marks the trained turns (every assistant turn; the rest is context) with the credit the
    trainer gives them (docs/agents.md): return-to-go R_k, and A_k = R_k - the mean return of the
    group's trajectories for grouped rollouts (a live row's running baseline is not kept)."""
    steps = [v.step for v in views]
    turns = [i for i, s in enumerate(steps) if s.role == "assistant" and (s.token_ids or s.content or s.tool_calls)]
    rewards = list(t.rewards.all())
    if not turns or not rewards:
        return
    returns = turn_returns(rewards[0].total, [s.reward for s in steps], turns)
    rewarded = [g["return"] for g in group if g["return"] is not None]
    baseline = sum(rewarded) / len(rewarded) if (t.extra or {}).get("group") and len(rewarded) > 1 else None
    for k, (i, r) in enumerate(zip(turns, returns, strict=True)):
        views[i].turn = {"index": k, "return": r, "advantage": r - baseline if baseline is not None else None,
                         "summary": bool((steps[i].extra or {}).get("summary")), "retokenised": not steps[i].token_ids}


def _step_view(step: Step) -> StepView:
    # A page draws one span per token and one heatmap column per token: past a size, the first
    # REPLAY_MAX_TOKENS are drawn and the rest is a count (the read API pages through them).
    limit = int(settings.REPLAY_MAX_TOKENS)
    all_ids = step.token_ids if isinstance(step.token_ids, list) else []
    ids = all_ids[:limit]
    logprobs = step.logprobs or []
    texts = (step.extra or {}).get("tokens") or []
    advantages = (step.extra or {}).get("advantages") or []
    tokens = []
    for i, tid in enumerate(ids):
        lp = logprobs[i] if i < len(logprobs) else None
        text = texts[i] if i < len(texts) and isinstance(texts[i], str) else f"#{tid}"
        adv = advantages[i] if i < len(advantages) else None
        tokens.append({"id": tid, "text": text, "logprob": lp, "colour": charts.token_colour(lp), "advantage": adv,
                       "title": f"id {tid} · logprob {lp}" + (f" · advantage {adv}" if adv is not None else "")})
    return StepView(step=step, tokens=tokens, routing=charts.routing_figure(step.routing, len(all_ids), limit),
                    hidden=len(all_ids) - len(ids), total=len(all_ids))


def rollout_replay(project: Project, trajectory_id: int, flt: RolloutFilter) -> dict[str, Any]:
    t = (Trajectory.objects.filter(project=project, id=trajectory_id)
         .prefetch_related(Prefetch("steps", queryset=Step.objects.order_by("index")),
                           Prefetch("rewards", queryset=Reward.objects.select_related("spec").order_by("-spec__version")),
                           Prefetch("rubric_scores", queryset=RubricScore.objects.order_by("aspect", "judge")))
         .first())
    if t is None:
        raise NotFound(f"there is no trajectory {trajectory_id} in {project.slug}", "Pick one from the rollout list.")
    feedback = list(FeedbackEvent.objects.filter(trajectory=t).order_by("occurred_at", "id")[:200])
    version = PolicyVersion.objects.filter(project=project, number=t.policy_version).first()
    steps, group = [_step_view(s) for s in t.steps.all()], _group(project, t)
    _turn_credit(t, steps, group)
    return {
        "t": t, "steps": steps, "feedback": feedback,
        "rewards": list(t.rewards.all()), "scores": list(t.rubric_scores.all()), "version": version,
        "prev": _neighbour(project, t, flt, older=False), "next": _neighbour(project, t, flt, older=True),
        "group": group, "timeline": charts.timeline_figure(t, feedback),
    }
