"""Reads for the dashboard pages: rollup tables for anything over time, bounded queries elsewhere.

Every selector runs a fixed number of queries whatever the row counts (tests assert it), and
returns plain data (dicts and lists) that the views hand to templates and Plotly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Avg, Count, F, Max, OuterRef, Prefetch, Q, Subquery, Sum
from django.db.models.functions import Coalesce, TruncMinute
from django.utils import timezone

from core.errors import NotFound
from feedback.models import Project, Trajectory
from feedback.selectors import project_for_member, projects_of, quarantine_recent, role_at_least
from training.models import (
    AuditLog,
    GateReport,
    PolicyVersion,
    Reward,
    RewardSpec,
    RubricScore,
    RunState,
    TrainingRun,
    TrainingStep,
    VersionState,
)
from webapp import charts, usefulness
from webapp.charts import METRICS
from webapp.models import AgreementRollup, FeedbackHourly, RubricRollup, TrajectoryHourly

POSITIVE = ("happy", "accept", "edit_kept")
NEGATIVE = ("sad", "reject", "followup_dissatisfied")
QUEUES = ("celery", "ingest", "rewards", "train", "rollouts", "gate")
MAX_CURVE_POINTS = 1500
PAGE_SIZE = 50


# --- access -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    role: str  # viewer | approver | admin (feedback.models.Membership)
    can_approve: bool


def project_access(user: Any, slug: str) -> tuple[Project, Access]:
    """The project and what `user` may do in it: members see it (any role), approvers and admins
    also decide. Not a member, or no such project: 404 (another project's existence is not told)."""
    project, role = project_for_member(user, slug)
    return project, Access(role=role, can_approve=role_at_least(role, "approver"))


def project_list(user: Any) -> list[dict[str, Any]]:
    """The projects `user` is a member of, with their totals."""
    projects = list(projects_of(user))
    ids = [p.id for p in projects]
    feedback = dict(FeedbackHourly.objects.filter(project_id__in=ids).values_list("project").annotate(n=Sum("n")))
    trajectories = dict(TrajectoryHourly.objects.filter(project_id__in=ids).values_list("project")
                        .annotate(n=Sum("trajectories")))
    return [{"slug": p.slug, "name": p.name, "feedback": feedback.get(p.id, 0), "trajectories": trajectories.get(p.id, 0)}
            for p in projects]


# --- overview -----------------------------------------------------------------------------------


# The loop moves in minutes: the last RECENT is shown per minute from the raw rows (bounded by the
# (project, occurred_at) index), older data per hour from the rollups.
RECENT = timedelta(hours=2)


def recent_cut(now: datetime) -> datetime:
    """Where hourly buckets stop and minute buckets start: the hour boundary before now - RECENT."""
    return (now - RECENT).replace(minute=0, second=0, microsecond=0)


def _add_point(s: dict[str, list], at: datetime, total: int, pos: int, neg: int) -> None:
    s["x"].append(at.isoformat())
    s["n"].append(total)
    s["rate"].append(round(pos / (pos + neg), 4) if pos + neg else None)


# Counted per minute and trajectory first, then each trajectory's version by one index lookup: a
# join would hash every trajectory of the project, a lookup per event repeats itself.
_FEEDBACK_MINUTES = """
SELECT m.at, (SELECT t.policy_version FROM feedback_trajectory t WHERE t.id = m.trajectory_id) AS version,
       sum(m.total)::bigint, sum(m.pos)::bigint, sum(m.neg)::bigint
FROM (
    SELECT date_trunc('minute', fe.occurred_at, 'UTC') AS at, fe.trajectory_id, count(*) AS total,
           count(*) FILTER (WHERE fe.signal = ANY(%(positive)s)) AS pos,
           count(*) FILTER (WHERE fe.signal = ANY(%(negative)s)) AS neg
    FROM feedback_feedbackevent fe WHERE fe.project_id = %(project)s AND fe.occurred_at >= %(start)s
    GROUP BY 1, 2
) m
GROUP BY 1, 2 ORDER BY 1
"""


def feedback_series(project: Project, since: datetime, cut: datetime) -> dict[str, Any]:
    """Per version: volume and positive rate (positive / (positive + negative)), per hour before
    `cut` (rollups) and per minute after it (raw events)."""
    hourly = (FeedbackHourly.objects.filter(project=project, hour__gte=since, hour__lt=cut)
              .values("hour", "policy_version")
              .annotate(total=Sum("n"), pos=Sum("n", filter=Q(signal__in=POSITIVE)),
                        neg=Sum("n", filter=Q(signal__in=NEGATIVE)))
              .order_by("hour").values_list("hour", "policy_version", "total", "pos", "neg"))
    with connection.cursor() as cur:
        cur.execute(_FEEDBACK_MINUTES, {"positive": list(POSITIVE), "negative": list(NEGATIVE),
                                        "project": project.id, "start": max(since, cut)})
        minutes = cur.fetchall()
    by_version: dict[int | None, dict[str, list]] = defaultdict(lambda: {"x": [], "n": [], "rate": []})
    total = positive = rated = 0
    for at, version, n, pos, neg in [*hourly, *minutes]:
        pos, neg = pos or 0, neg or 0
        _add_point(by_version[version], at, n, pos, neg)
        total, positive, rated = total + n, positive + pos, rated + pos + neg
    return {"by_version": dict(by_version), "total": total, "rate": positive / rated if rated else None}


def reward_series(project: Project, since: datetime, cut: datetime) -> dict[int | None, dict[str, list]]:
    """Per version: mean reward (latest spec per trajectory), per hour before `cut`, per minute after."""
    rows = list(TrajectoryHourly.objects.filter(project=project, hour__gte=since, hour__lt=cut)
                .values_list("hour", "policy_version", "trajectories", "rewarded", "reward_sum").order_by("hour"))
    spec = Subquery(RewardSpec.objects.filter(project=project).order_by("-version").values("id")[:1])
    # The reward by one index lookup per recent trajectory: a join would hash every reward.
    reward = Subquery(Reward.objects.filter(trajectory=OuterRef("pk"), spec_id=spec).values("total")[:1])
    rows += list(Trajectory.objects.filter(project=project, occurred_at__gte=max(since, cut))
                 .annotate(at=TruncMinute("occurred_at"), reward=reward).values("at", "policy_version")
                 .annotate(n=Count("id"), rewarded=Count("reward"), reward_sum=Coalesce(Sum("reward"), 0.0))
                 .order_by("at").values_list("at", "policy_version", "n", "rewarded", "reward_sum"))
    out: dict[int | None, dict[str, list]] = defaultdict(lambda: {"x": [], "reward": [], "trajectories": []})
    for at, version, n, rewarded, reward_sum in rows:
        s = out[version]
        s["x"].append(at.isoformat())
        s["reward"].append(round(reward_sum / rewarded, 4) if rewarded else None)
        s["trajectories"].append(n)
    return dict(out)


def promotion_marks(project: Project, since: datetime) -> list[tuple[str, str]]:
    """(time, version name) of every promotion to production in the range, at the moment it
    happened (the audit log), not at the version's first data."""
    rows = (AuditLog.objects.filter(project=project, at__gte=since, after__state=VersionState.PRODUCTION)
            .order_by("at").values_list("at", "after"))
    return [(at.isoformat(), charts.version_name(after.get("number"))) for at, after in rows]


def overview_charts(project: Project, days: int) -> dict[str, Any]:
    now = timezone.now()
    since, cut = now - timedelta(days=days), recent_cut(now)
    feedback, rewards = feedback_series(project, since, cut), reward_series(project, since, cut)
    return charts.overview_figures(feedback, rewards, promotion_marks(project, since), cut)


def versions_live(project: Project) -> list[PolicyVersion]:
    return list(PolicyVersion.objects.filter(project=project, state__in=("production", "canary", "awaiting_approval"))
                .order_by("-number")[:10])


def accept_by_version(project: Project, days: int, limit: int = 8) -> list[dict[str, Any]]:
    """The newest `limit` versions that served or were gated, newest first, each with:
    live: suggestions the users accepted per live completion that version served in the range
    (silence counts as not accepted, so going quiet never looks better); held_out: the accept rate
    the users' reward model predicts on the gate's held-out suite (the version's newest gate
    report, as candidate or else as the production it was compared with; None before there were
    enough clicks to fit one); accepted_chars: characters the users accepted per live completion
    served (what they did not have to type: the utility); invented_share, recent: what it writes
    now (webapp.usefulness.writes_now)."""
    now = timezone.now()
    since = now - timedelta(days=days)
    versions = list(PolicyVersion.objects.filter(project=project).exclude(state__in=("candidate", "failed"))
                    .order_by("-number").values("number", "state", "created_at")[:limit])
    numbers = [v["number"] for v in versions]
    served = usefulness.served_by_version(project, numbers, since, recent_cut(now))
    held: dict[int, float | None] = {}
    reports = (GateReport.objects.filter(version__project=project, policy__suite__has_key="accept")
               .filter(Q(version__number__in=numbers) | Q(baseline__number__in=numbers))
               .order_by("-created_at").values_list("version__number", "baseline__number", "policy")[:4 * limit])
    for number, baseline, policy in reports:
        accept = (policy.get("suite") or {}).get("accept") or {}
        held.setdefault(number, accept.get("candidate"))
        if baseline is not None and baseline not in held:
            held[baseline] = accept.get("production")
    writes = usefulness.writes_now(project, numbers, since)
    return [{**v, **_served(served.get(v["number"])), "held_out": held.get(v["number"]),
             **_writes(writes.get(v["number"]))} for v in versions]


def _served(row: usefulness.Served | None) -> dict[str, Any]:
    if row is None or not row.served:
        return {"served": row.served if row else 0, "live": None, "accepted_chars": None}
    return {"served": row.served, "live": row.accepted / row.served, "accepted_chars": row.chars / row.served}


def _writes(row: dict[str, Any] | None) -> dict[str, Any]:
    return {"invented_share": row["invented_share"] if row else None, "recent": row["recent"] if row else []}


def run_active(project: Project) -> dict[str, Any] | None:
    run = (TrainingRun.objects.filter(project=project, state__in=("queued", "running"))
           .select_related("base_version").order_by("-created_at").first())
    if run is None:
        return None
    last = TrainingStep.objects.filter(run=run).order_by("-step").values("step", "loss", "reward_mean").first()
    return {"run": run, "last": last, "percent": round(100 * min(max(run.progress, 0.0), 1.0), 1)}


def queue_depths() -> dict[str, int | None]:
    """Messages waiting per Celery queue (Redis lists of the broker); None when Redis is away."""
    import redis

    try:
        client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=0.5, socket_connect_timeout=0.5)
        with client.pipeline(transaction=False) as pipe:
            for name in QUEUES:
                pipe.llen(name)
            return dict(zip(QUEUES, pipe.execute(), strict=True))
    except redis.RedisError:
        return dict.fromkeys(QUEUES)


def errors_recent(project: Project) -> dict[str, Any]:
    failed = list(TrainingRun.objects.filter(project=project, state=RunState.FAILED).order_by("-created_at")
                  .values("id", "error", "finished_at", "created_at")[:5])
    judge = RubricRollup.objects.filter(project=project, tag="", bin=-1).aggregate(n=Sum("n"))["n"] or 0
    return {"runs": failed, "judge_failures": judge, "quarantined": quarantine_recent(project)}


# --- training runs ------------------------------------------------------------------------------


def run_list(project: Project) -> list[TrainingRun]:
    return list(TrainingRun.objects.filter(project=project).select_related("base_version", "candidate")
                .order_by("-created_at")[:PAGE_SIZE])


def run_get(project: Project, run_id: int | None, runs: list[TrainingRun]) -> TrainingRun | None:
    if run_id is None:
        return next((r for r in runs if r.state == RunState.RUNNING), runs[0] if runs else None)
    run = next((r for r in runs if r.id == run_id), None)
    run = run or TrainingRun.objects.filter(project=project, id=run_id).select_related("base_version", "candidate").first()
    if run is None:
        raise NotFound(f"there is no training run {run_id} in {project.slug}", "Pick a run from the list.")
    return run


def run_curves(run: TrainingRun) -> dict[str, list]:
    """Metric curves of a run, at most MAX_CURVE_POINTS points (every k-th step of a long run)."""
    last = TrainingStep.objects.filter(run=run).aggregate(m=Max("step"))["m"] or 0
    stride = max(1, math.ceil(last / MAX_CURVE_POINTS))
    steps = TrainingStep.objects.filter(run=run)
    if stride > 1:
        steps = steps.annotate(mod=F("step") % stride).filter(Q(mod=0) | Q(step=last))
    rows = list(steps.order_by("step").values_list("step", *METRICS))
    curves: dict[str, list] = {"step": [r[0] for r in rows]}
    for i, name in enumerate(METRICS, start=1):
        curves[name] = [r[i] for r in rows]
    return curves


# --- rubric scores ------------------------------------------------------------------------------


def rubric_filters(project: Project) -> dict[str, list[str]]:
    base = RubricRollup.objects.filter(project=project)
    return {"tasks": sorted(base.filter(tag="").values_list("task", flat=True).distinct()),
            "tags": sorted(t for t in base.values_list("tag", flat=True).distinct() if t)}


def rubric_view(project: Project, task: str, tag: str) -> dict[str, Any]:
    rows = RubricRollup.objects.filter(project=project, tag=tag)
    agreement = AgreementRollup.objects.filter(project=project, tag=tag)
    if task:
        rows, agreement = rows.filter(task=task), agreement.filter(task=task)
    hist: dict[tuple, dict[int, int]] = defaultdict(dict)
    sums: dict[tuple, float] = defaultdict(float)
    for version, aspect, source, b, n, s in (rows.values_list("policy_version", "aspect", "source", "bin")
                                             .annotate(n=Sum("n"), s=Sum("score_sum"))):
        hist[(version, aspect, source)][b] = n
        sums[(version, aspect, source)] += s
    agree = list(agreement.values("aspect").annotate(pairs=Sum("pairs"), agree=Sum("agree"), err=Sum("abs_err_sum"))
                 .order_by("aspect"))
    for a in agree:
        a["rate"] = a["agree"] / a["pairs"] if a["pairs"] else None
        a["mae"] = a["err"] / a["pairs"] if a["pairs"] else None
    return {"figures": charts.rubric_figures(hist, sums, agree), "agreement": agree,
            "judge_failures": sum(h.get(-1, 0) for k, h in hist.items() if k[2] == "judge")}


def reward_model_history(project: Project, limit: int = 20) -> list[dict[str, Any]]:
    """The users' reward model as each recent run fitted it (newest first): clicks it was fitted on
    and its calibration on the newest clicks it never saw (training.rewards.reward_model)."""
    runs = (TrainingRun.objects.filter(project=project, state=RunState.SUCCEEDED, result__has_key="reward_model")
            .order_by("-finished_at")[:limit])
    out = []
    for run in runs:
        model = run.result.get("reward_model")
        if model:
            out.append({"run": run.pk, "finished_at": run.finished_at, "rollouts": run.result.get("rollouts"), **model})
    return out


def rubric_strip(project: Project, task: str, tag: str, limit: int = 400) -> dict[str, Any]:
    """The newest judge scores of the filter, one point each (a bounded sample for the strip plot)."""
    scores = RubricScore.objects.filter(trajectory__project=project, score__isnull=False)
    if task:
        scores = scores.filter(trajectory__task=task)
    if tag:
        scores = scores.filter(trajectory__tags__contains=[tag])
    rows = list(scores.order_by("-id").values_list("aspect", "score", "trajectory__policy_version")[:limit])
    by_aspect: dict[str, dict[str, list]] = defaultdict(lambda: {"x": [], "y": []})
    for aspect, score, version in rows:
        by_aspect[aspect]["x"].append(charts.version_name(version))
        by_aspect[aspect]["y"].append(score)
    data = [{"type": "box", "boxpoints": "all", "jitter": 0.6, "pointpos": 0, "fillcolor": "rgba(0,0,0,0)",
             "line": {"width": 0}, "name": a, "x": s["x"], "y": s["y"]} for a, s in sorted(by_aspect.items())]
    return {"data": data, "layout": {"title": {"text": f"Newest {len(rows)} judge scores"}, "boxmode": "group",
                                     "yaxis": {"range": [0, 1]}, "margin": {"t": 40, "r": 10, "l": 40},
                                     "legend": {"orientation": "h"}}}


# --- model registry -----------------------------------------------------------------------------


def registry(project: Project) -> list[dict[str, Any]]:
    """Versions as a lineage tree (depth-first, children newest first), each with its run and gate."""
    versions = list(PolicyVersion.objects.filter(project=project).order_by("-number")
                    .prefetch_related(Prefetch("gate_reports", queryset=GateReport.objects.order_by("-created_at")),
                                      Prefetch("runs_to", queryset=TrainingRun.objects.order_by("-created_at")))[:200])
    by_parent: dict[int | None, list[PolicyVersion]] = defaultdict(list)
    ids = {v.id for v in versions}
    for v in versions:
        by_parent[v.parent_id if v.parent_id in ids else None].append(v)
    rows: list[dict[str, Any]] = []
    stack = [(v, 0) for v in reversed(by_parent[None])]
    while stack:
        v, depth = stack.pop()
        gates = list(v.gate_reports.all())
        runs = list(v.runs_to.all())
        rows.append({"v": v, "depth": depth, "gate": gates[0] if gates else None, "run": runs[0] if runs else None})
        stack.extend((c, depth + 1) for c in reversed(by_parent[v.id]))
    return rows


def audit_log(project: Project, limit: int = 50) -> list[AuditLog]:
    return list(AuditLog.objects.filter(project=project).order_by("-at", "-id")[:limit])



# --- figures for /metrics (read at scrape time; each one query) --------------------------------

REWARD_WINDOW = timedelta(hours=24)


def metrics_versions_by_state() -> list[dict[str, Any]]:
    return list(PolicyVersion.objects.values("project__slug", "state").annotate(n=Count("id"))
                .order_by("project__slug", "state"))


def metrics_reward_means() -> list[dict[str, Any]]:
    """Mean reward of the trajectories each version served, over rewards computed in the last 24 h."""
    since = timezone.now() - REWARD_WINDOW
    return list(Reward.objects.filter(computed_at__gte=since, trajectory__policy_version__isnull=False)
                .values("trajectory__project__slug", "trajectory__policy_version")
                .annotate(mean=Avg("total"), n=Count("id")).order_by())


def metrics_training_latest() -> list[dict[str, Any]]:
    """Each project's newest optimiser step (of its newest run that logged one)."""
    return list(TrainingStep.objects.order_by("run__project_id", "-run__created_at", "-step")
                .distinct("run__project_id").values("run__project__slug", "step", "tokens_per_s"))


def metrics_dropped_stale() -> list[dict[str, Any]]:
    return list(TrainingStep.objects.values("run__project__slug").annotate(n=Sum("dropped_stale")).order_by())
