"""Reads of promotion: the project's gate policy, live canary counts."""

from __future__ import annotations

from typing import Any

from django.db.models import Count

from feedback.models import FeedbackEvent, Project
from training.models import CanaryRun, GatePolicy
from training.promotion.sequential import ArmCounts

SUCCESS_SIGNALS = ("accept", "happy", "edit_kept")
FAILURE_SIGNALS = ("reject", "sad", "followup_dissatisfied")
POLICY_FIELDS = ("thresholds", "two_person_rule", "canary_share", "canary_min_events", "canary_max_events",
                 "canary_confidence")


def gate_policy_active(project: Project) -> GatePolicy:
    """Selector: the newest GatePolicy, or the defaults (unsaved, version 0) when none was set."""
    policy = GatePolicy.objects.filter(project=project).order_by("-version").first()
    return policy or GatePolicy(project=project, version=0)


def gate_policy_json(policy: GatePolicy) -> dict[str, Any]:
    return {"version": policy.version, **{f: getattr(policy, f) for f in POLICY_FIELDS}}


def canary_counts(run: CanaryRun) -> tuple[ArmCounts, ArmCounts]:
    """Selector: live success/failure signals since the canary began, (canary, production)."""
    numbers = {run.version.number: "canary", run.baseline.number: "production"}
    rows = (FeedbackEvent.objects.filter(project_id=run.version.project_id, occurred_at__gte=run.started_at,
                                         trajectory__policy_version__in=list(numbers),
                                         signal__in=SUCCESS_SIGNALS + FAILURE_SIGNALS)
            .values("trajectory__policy_version", "signal").annotate(n=Count("id")))
    tally = {"canary": [0, 0], "production": [0, 0]}
    for row in rows:
        arm = tally[numbers[row["trajectory__policy_version"]]]
        arm[0 if row["signal"] in SUCCESS_SIGNALS else 1] += row["n"]
    return ArmCounts(*tally["canary"]), ArmCounts(*tally["production"])
