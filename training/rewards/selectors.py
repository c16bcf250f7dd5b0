"""Reads of rewards: what is rewarded, what waits to be scored, judge-vs-human agreement."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import (
    BigIntegerField,
    DateTimeField,
    Exists,
    F,
    Max,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Greatest

from feedback.models import FeedbackEvent, Project, Quarantine, Step, Trajectory
from feedback.selectors import in_project, trainable
from training.models import AgentTask, Reward, RewardSpec, RubricScore
from training.rewards.calibration import Agreement, aspect_agreement
from training.rewards.reward_model import Labelled
from training.rewards.spec import RewardSpecData


def trajectories_reward_pending(project: Project, spec: RewardSpec, now: datetime,
                                among: Sequence[int] | None = None, rescore: Sequence[int] = ()
                                ) -> QuerySet[Trajectory]:
    """Trajectories whose feedback has settled and whose reward under `spec` is missing or older
    than their newest feedback (late feedback makes a reward stale), or is among `rescore`
    (feedback linked to them after their reward). Quarantined ones are left out: scoring them
    raised, and retrying the oldest item forever would stall the queue.
    `among`: only these ids, the project's own (the due rows'), found by the primary key alone:
    with the project in the filter too, a project that grew after the last ANALYZE looks empty
    to the planner, which then read all of its rows to pick out these (tests/training/rewards/
    test_reward_queue.py); None: the whole project."""
    scope = Q(project=project) if among is None else Q(pk__in=among)
    quarantined = Quarantine.objects.filter(trajectory=OuterRef("pk"), kind="reward")
    # The spec's id hidden from the planner (an InitPlan), as feedback.selectors.in_project hides a
    # project's: a spec newer than the table's last ANALYZE looks empty to it, and it probed the
    # spec's index for every trajectory, reading all of the spec's rewards each time (2 s for
    # 5,000 trajectories; tests/training/rewards/test_reward_queue.py).
    spec_id = RawSQL("(SELECT %s::bigint)", [spec.pk], output_field=BigIntegerField())
    rewarded_at = Reward.objects.filter(trajectory=OuterRef("pk"), spec_id=spec_id).values("computed_at")[:1]
    settled_before = now - timedelta(seconds=spec.settle_seconds)
    stale = Q(rewarded_at__isnull=True) | Q(rewarded_at__lt=F("last_feedback"))
    # Each trajectory's newest feedback by its own probe of the feedback's trajectory index: as a
    # join and GROUP BY, a few thousand trajectories (a full pass's window, a large batch's due rows)
    # were hashed against every feedback row of the deployment (445,300 read for 4,000 at 200,000
    # trajectories: bench/reward_queue.py).
    newest = (FeedbackEvent.objects.filter(trajectory=OuterRef("pk")).order_by().values("trajectory")
              .annotate(newest=Max("received_at")).values("newest"))
    return (
        Trajectory.objects.filter(scope)
        .exclude(source="eval")
        .exclude(Exists(quarantined))
        .annotate(last_feedback=Subquery(newest, output_field=DateTimeField()))
        .annotate(
            last_activity=Greatest(Coalesce("last_feedback", "received_at"), "received_at"),
            rewarded_at=Subquery(rewarded_at, output_field=DateTimeField()),
        )
        .filter(last_activity__lte=settled_before)
        .filter(stale | Q(pk__in=rescore) if rescore else stale)
        .order_by("received_at")
    )


def reward_due_rows(project: Project, settled_before: datetime, cap: int) -> list[tuple[int, list[int], bool]]:
    """The project's due rows (training.models.RewardDue) whose activity settled by
    `settled_before`, oldest first, as (row id, trajectory ids, rescore): rows until they name
    `cap` trajectories (at least one row)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT id, trajectory_ids, rescore FROM (SELECT id, trajectory_ids, rescore, at, "
            "sum(cardinality(trajectory_ids)) OVER (ORDER BY at, id) - cardinality(trajectory_ids) AS before "
            "FROM training_rewarddue WHERE project_id = %s AND at <= %s) d WHERE before < %s ORDER BY at, id",
            [project.pk, settled_before, cap],
        )
        return [(row_id, list(ids), rescore) for row_id, ids, rescore in cur.fetchall()]


def trajectory_window(project: Project, after: str | None, size: int) -> list[tuple[int, str]]:
    """The project's next `size` trajectories after external id `after` (None: from the first), in
    the order of the project's unique key, as (id, external id): one range of its index, whatever
    the project's size or the planner's statistics (the project id hidden, as in_project says)."""
    rows = Trajectory.objects.filter(in_project(project))
    if after is not None:
        rows = rows.filter(external_id__gt=after)
    # Sorting off for this one query: a project the statistics do not know yet is estimated at one
    # row, a sort of it looks free, and the planner took another of the project's indexes and
    # sorted all of its rows for every window (tests/training/rewards/test_reward_queue.py); the
    # unique index gives them in order already.
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT current_setting('enable_sort'), set_config('enable_sort', 'off', true)")
        previous = cur.fetchone()[0]
        try:
            return list(rows.order_by("external_id").values_list("pk", "external_id")[:size])
        finally:
            cur.execute("SELECT set_config('enable_sort', %s, true)", [previous])


def rewarded_trajectories_since(
    project: Project, spec: RewardSpec, since: datetime | None, until: datetime | None = None
) -> QuerySet[Reward]:
    """Rewards under `spec` of trajectories received in (since, until], for training (no eval,
    nothing `feedback.selectors.trainable` leaves out)."""
    rewards = trainable(Reward.objects.filter(spec=spec, trajectory__project=project), "trajectory").exclude(
        trajectory__source="eval")
    if since is not None:
        rewards = rewards.filter(trajectory__received_at__gt=since)
    if until is not None:
        rewards = rewards.filter(trajectory__received_at__lte=until)
    return rewards.select_related("trajectory").order_by("trajectory__received_at", "trajectory_id")


def _human_labels(project: Project) -> dict[tuple[int, str], float]:
    """(trajectory id, aspect) -> mean human label over the feedback events that carry one."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    events = FeedbackEvent.objects.filter(project=project, trajectory__isnull=False, aspect_labels__isnull=False)
    for trajectory_id, labels in events.values_list("trajectory_id", "aspect_labels"):
        for aspect, value in (labels or {}).items():
            sums[(trajectory_id, aspect)].append(float(value))
    return {key: sum(values) / len(values) for key, values in sums.items()}


def judge_agreement(
    project: Project, threshold: float = 0.5, human_threshold: float | None = None
) -> dict[str, dict[str, Agreement]]:
    """judge id -> aspect -> agreement (Spearman, Cohen's kappa) between judge and human labels."""
    humans = _human_labels(project)
    rows: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    scores = RubricScore.objects.filter(trajectory__project=project, score__isnull=False)
    for trajectory_id, aspect, judge, score in scores.values_list("trajectory_id", "aspect", "judge", "score"):
        human = humans.get((trajectory_id, aspect))
        if human is not None:
            rows[judge].append((aspect, score, human))
    return {judge: aspect_agreement(r, threshold, human_threshold) for judge, r in sorted(rows.items())}


def signal_rows(project: Project) -> list[dict[str, Any]]:
    """The current spec's signal -> reward map as the rubric page shows it (the defaults before a
    spec exists): each signal's full reward and, for a graded one, how its value scales it."""
    spec = RewardSpec.objects.filter(project=project).order_by("-version").first()
    data = RewardSpecData.from_json(spec.signal_rewards if spec is not None else None)
    rows = []
    for name, reward in data.signal_rewards.items():
        grade = data.grades.get(name)
        how = ("" if grade is None else f"x min(chars, {grade.scale:g}) / {grade.scale:g}" if grade.unit == "chars"
               else "x kept fraction")
        rows.append({"signal": name, "reward": reward, "graded": how})
    return rows


CLICKS = ("accept", "reject")


def labelled_suggestions(project: Project, spec: RewardSpec, limit: int = 4000) -> list[Labelled]:
    """The newest `limit` live suggestions a user accepted or rejected, oldest first, with their
    check outcomes under `spec` (its reward components): what the reward model is fitted on.
    The later of accept/reject on one suggestion is its label: 0 for a reject, for an accept 1 or,
    when the spec grades accepts, the share of the reward its value earned (a partial accept)."""
    weights = {c["name"]: float(c.get("weight", 1.0)) for c in spec.checks}
    grade = RewardSpecData.from_json(spec.signal_rewards).grades.get("accept")
    clicked = FeedbackEvent.objects.filter(trajectory=OuterRef("trajectory"), signal__in=CLICKS)
    rewards = (
        trainable(Reward.objects.filter(spec=spec, trajectory__project=project, trajectory__source="live"),
                  "trajectory")
        .filter(Exists(clicked))
        .select_related("trajectory")
        .prefetch_related(
            Prefetch("trajectory__steps", queryset=Step.objects.filter(role="assistant").order_by("index")),
            Prefetch("trajectory__feedback_events",
                     queryset=FeedbackEvent.objects.filter(signal__in=CLICKS).order_by("occurred_at", "id")),
        )
        .order_by("-trajectory__received_at", "-trajectory_id")[:limit]
    )
    out = []
    for reward in reversed(list(rewards)):
        trajectory = reward.trajectory
        events = list(trajectory.feedback_events.all())
        steps = list(trajectory.steps.all())
        messages = trajectory.prompt or []
        checks = {name: (reward.components.get(f"check:{name}", 0.0) / w if w else 0.0) for name, w in weights.items()}
        out.append(Labelled(
            prompt=str(messages[-1].get("content", "")) if messages else "",
            completion="".join(s.content for s in steps),
            checks=checks,
            completion_ids=[int(t) for s in steps for t in (s.token_ids or [])],
            label=_label(events[-1], grade),
            source_id=trajectory.pk,
            prompt_ids=_recorded_prompt(trajectory, steps),
        ))
    return out


def _recorded_prompt(trajectory: Trajectory, steps: list[Step]) -> list[int]:
    """The ids the serving engine was fed before the first assistant step, when recorded (else []:
    the context reward model encodes the prompt text)."""
    for extra in ([steps[0].extra] if steps else []) + [trajectory.extra]:
        ids = extra.get("prompt_token_ids") if isinstance(extra, dict) else None
        if isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids):
            return ids
    return []


def _label(event: FeedbackEvent, grade: Any) -> float:
    if event.signal != "accept":
        return 0.0
    return grade.factor(event.value) if grade is not None else 1.0


def agent_tasks(project: Project) -> list[Any]:
    """The project's registered agent tasks (by name), as the rollouts take them
    (training.rewards.agents.AgentTask; imported here: the rollouts' tools import torch)."""
    from training.rewards import agents

    return [agents.AgentTask(t.name, t.instruction, dict(t.files), t.tests)
            for t in AgentTask.objects.filter(project=project).order_by("name")]
