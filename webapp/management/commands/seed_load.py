"""Fills a project with a realistic dashboard load, fast (INSERT ... SELECT generate_series).

    .venv/bin/python manage.py seed_load --events 1000000 --trajectories 100000 [--project slug]

Eight policy versions (a lineage v1 → v8: retired ones, v6 in production, v7 on canary, v8
awaiting approval), trajectories over the last 14 days in groups of 4 rollouts per prompt, one
step each with tokens, behaviour log-probs and (one in 50) MoE routing, feedback events whose
accept rate improves with the version, rewards, judge scores for one trajectory in five, human
aspect labels, training runs with their steps (one still running), gate reports and the audit
log. Then the rollups are rebuilt. Running it again adds another load to the same project.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection, transaction

from feedback.models import Project
from feedback.services import project_create
from training.models import (
    AuditLog,
    GateReport,
    PolicyVersion,
    RewardSpec,
    RunState,
    TrainingRun,
    VersionState,
)
from training.rl.config import RLConfig
from training.runs.settings import RunSettings
from webapp.rollups import rollups_rebuild

VERSIONS = 8
SPAN_HOURS = 14 * 24
ASPECTS = ("correctness", "style", "helpfulness")
_STATES = {6: VersionState.PRODUCTION, 7: VersionState.CANARY, 8: VersionState.AWAITING_APPROVAL}

_TRAJECTORIES = """
INSERT INTO feedback_trajectory (project_id, external_id, policy_version, source, task, tags, prompt, extra,
                                 occurred_at, received_at)
SELECT %(project)s, %(prefix)s || '-t' || i,
       CASE WHEN i > 0.95 * %(n)s AND i %% 5 = 0 THEN 7 ELSE 1 + (i * 6) / (%(n)s + 1) END,
       'live', (ARRAY['tab-completion', 'chat', 'refactor', 'tests'])[1 + (i / 4) %% 4],
       (ARRAY['["python"]', '["js", "ide"]', '["python", "ide"]'])[1 + (i / 4) %% 3]::jsonb,
       jsonb_build_array(jsonb_build_object('role', 'user', 'content', 'def f' || (i / 4) || '(x):')),
       jsonb_build_object('group', %(prefix)s || '-g' || (i / 4)),
       now() - make_interval(secs => %(span)s * (1 - (i / 4) * 4.0 / %(n)s)),
       now() - make_interval(secs => %(span)s * (1 - (i / 4) * 4.0 / %(n)s) - 2)
FROM generate_series(1, %(n)s) AS i
"""

_STEPS = """
INSERT INTO feedback_step (trajectory_id, index, role, content, tool_calls, token_ids, logprobs, routing, extra)
SELECT t.id, 0, 'assistant', ' return x + ' || (t.id %% 97),
       CASE WHEN t.id %% 10 = 0 THEN '[{"name": "run_tests", "arguments": {"path": "tests/"}}]'::jsonb END,
       (SELECT jsonb_agg((t.id * 7 + k * 13) %% 32000) FROM generate_series(1, 16) k),
       (SELECT jsonb_agg(round((-random() * random() * 3)::numeric, 3)) FROM generate_series(1, 16) k),
       -- by the trajectory's ordinal, not its id: ids depend on the sequence's history
       CASE WHEN split_part(t.external_id, '-t', 2)::int %% 50 = 4 THEN (
           SELECT jsonb_agg(pos) FROM (
               SELECT (SELECT jsonb_agg(jsonb_build_array((p * 3 + l * 5) %% 8, (p + l * 7 + 1) %% 8))
                       FROM generate_series(0, 3) l) AS pos
               FROM generate_series(0, 15) p) x)
       END,
       jsonb_build_object('tokens', (SELECT jsonb_agg(w) FROM unnest(
           ARRAY[' return', ' x', ' +', ' ', '1', '\n', '#', ' add', ' one', ' to', ' x', '\n', 'def', ' g',
                 '(', ')']) w))
FROM feedback_trajectory t WHERE t.project_id = %(project)s AND t.external_id LIKE %(like)s
"""

_FEEDBACK = """
INSERT INTO feedback_feedbackevent (project_id, event_id, trajectory_external_id, trajectory_id, signal, value,
                                    step, user_hash, aspect_labels, extra, occurred_at, received_at)
SELECT %(project)s, %(prefix)s || '-f' || j, t.external_id, t.id,
       CASE WHEN j %% 7 = 0 THEN (CASE WHEN random() < 0.45 + 0.04 * t.policy_version THEN 'happy' ELSE 'sad' END)
            WHEN j %% 23 = 0 THEN 'edit_kept'
            WHEN random() < 0.40 + 0.04 * t.policy_version THEN 'accept' ELSE 'reject' END,
       NULL, 0, md5('u' || (j %% 5000)),
       CASE WHEN j %% 50 = 0 THEN jsonb_build_object('correctness', round(random()::numeric, 2),
                                                     'style', round(random()::numeric, 2)) END,
       '{}'::jsonb, t.occurred_at + make_interval(secs => j %% 300), t.occurred_at + make_interval(secs => j %% 300 + 1)
FROM generate_series(1, %(events)s) AS j
JOIN feedback_trajectory t ON t.id = %(first)s + (j %% %(n)s)
"""

_REWARDS = """
INSERT INTO training_reward (trajectory_id, spec_id, total, components, computed_at)
SELECT t.id, %(spec)s, round((0.05 * t.policy_version + random() * 0.6 - 0.2)::numeric, 4), '{}'::jsonb, now()
FROM feedback_trajectory t WHERE t.project_id = %(project)s AND t.external_id LIKE %(like)s
"""

_RUBRIC = """
INSERT INTO training_rubricscore (trajectory_id, aspect, score, rationale, judge, error, created_at)
SELECT t.id, a,
       CASE WHEN t.id %% 500 = 0 THEN NULL
            ELSE least(1, greatest(0, round((0.3 + 0.06 * t.policy_version + (random() - 0.5) * 0.5)::numeric, 3)))
       END,
       CASE WHEN t.id %% 500 = 0 THEN '' ELSE 'The ' || a || ' looks ' ||
            (ARRAY['solid', 'acceptable', 'weak'])[1 + t.id %% 3] || ' for this prompt.' END,
       'rule-v1', CASE WHEN t.id %% 500 = 0 THEN 'judge timed out' ELSE '' END, t.received_at + interval '1 minute'
FROM feedback_trajectory t CROSS JOIN unnest(%(aspects)s::text[]) a
WHERE t.project_id = %(project)s AND t.external_id LIKE %(like)s AND (t.id - %(first)s) %% 5 = 0
"""

_STEPS_OF_RUN = """
INSERT INTO training_trainingstep (run_id, step, loss, kl_ref, entropy, clip_fraction, mismatch_kl, grad_norm,
                                   reward_mean, tokens_per_s, dropped_stale, created_at)
SELECT %(run)s, s, 0.9 * exp(-s / 120.0) + random() * 0.05, 0.002 * s / 10 + random() * 0.001,
       2.2 - s / 400.0 + random() * 0.05, 0.05 + random() * 0.1, random() * 0.002, 1 + random(),
       0.1 + 0.5 * (1 - exp(-s / 100.0)) + random() * 0.05, 9000 + random() * 2000, (s %% 17 = 0)::int,
       now() - make_interval(secs => %(steps)s - s)
FROM generate_series(1, %(steps)s) s
"""


class Command(BaseCommand):
    help = "Fill a project with a realistic dashboard load (feedback, trajectories, runs, versions)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--events", type=int, default=1_000_000)
        parser.add_argument("--trajectories", type=int, default=100_000)
        parser.add_argument("--project", default="loadtest")
        parser.add_argument("--run-steps", type=int, default=300)

    def handle(self, *args: Any, **opts: Any) -> None:
        start = time.perf_counter()
        project = _project(opts["project"])
        n, events = max(opts["trajectories"], 4), opts["events"]
        with transaction.atomic():
            versions = _versions(project)
            spec = _spec(project)
            prefix = f"seed{time.time_ns() // 1000}"
            _load_rows(project, spec, prefix, n, events)
            _runs(project, versions, opts["run_steps"])
        touched = rollups_rebuild()
        self.stdout.write(f"seeded {project.slug}: {n} trajectories, {events} feedback events, "
                          f"{len(versions)} versions; rollups {touched}; {time.perf_counter() - start:.1f} s")


def _project(slug: str) -> Project:
    existing = Project.objects.filter(slug=slug).first()
    if existing:
        return existing

    return project_create(f"Load {slug}", slug).project


def _versions(project: Project) -> dict[int, PolicyVersion]:
    out: dict[int, PolicyVersion] = {}
    for number in range(1, VERSIONS + 1):
        out[number], _ = PolicyVersion.objects.get_or_create(
            project=project, number=number,
            defaults={"parent": out.get(number - 1), "state": _STATES.get(number, "retired"),
                      "manifest_hash": f"{number:064x}", "delta_bytes": None if number == 1 else 2_000_000 + number,
                      "delta_ratio": None if number == 1 else round(0.2 + number / 100, 3),
                      "config": {"lr": 1e-6, "kl_beta": 0.02}})
    return out


def _spec(project: Project) -> RewardSpec:
    spec = RewardSpec.objects.filter(project=project).order_by("-version").first()
    return spec or RewardSpec.objects.create(
        project=project, version=1, signal_rewards={"accept": 0.75, "reject": -0.25},
        aspects=[{"name": a, "weight": 1.0} for a in ASPECTS])


def _load_rows(project: Project, spec: RewardSpec, prefix: str, n: int, events: int) -> None:
    params = {"project": project.id, "prefix": prefix, "like": f"{prefix}-t%", "n": n, "events": events,
              "span": SPAN_HOURS * 3600, "spec": spec.id, "aspects": list(ASPECTS)}
    with connection.cursor() as cur:
        cur.execute(_TRAJECTORIES, params)
        cur.execute("SELECT min(id), max(id) FROM feedback_trajectory WHERE project_id = %s AND external_id LIKE %s",
                    [project.id, params["like"]])
        first, last = cur.fetchone()
        # Ids are dense inside one INSERT ... SELECT in this transaction; feedback uses id arithmetic.
        params["first"], params["n"] = first, last - first + 1
        for sql in (_STEPS, _FEEDBACK, _REWARDS, _RUBRIC):
            cur.execute(sql, params)


def _runs(project: Project, versions: dict[int, PolicyVersion], steps: int) -> None:
    if TrainingRun.objects.filter(project=project).exists():
        return
    with connection.cursor() as cur:
        for number in range(2, VERSIONS + 2):
            done = number <= VERSIONS
            run = TrainingRun.objects.create(
                project=project, base_version=versions[min(number - 1, 6)], candidate=versions.get(number) if done else None,
                state=RunState.SUCCEEDED if done else "running", progress=1.0 if done else 0.4,
                settings=RunSettings(steps=steps, batch_size=64, rl=RLConfig(lr=1e-6 * number, beta=0.02)).to_dict(),
                worker="seed@localhost")
            cur.execute(_STEPS_OF_RUN, {"run": run.id, "steps": steps if done else int(steps * 0.4)})
            if done:
                _gate_and_audit(project, versions[number], versions[number - 1])


def _gate_and_audit(project: Project, version: PolicyVersion, baseline: PolicyVersion) -> None:
    checks = [{"name": f"{a} non-regression", "value": 0.6 + version.number / 100, "threshold": 0.55,
               "interval": [0.55, 0.7], "passed": True} for a in ASPECTS]
    checks.append({"name": "kl budget", "value": 0.01, "threshold": 0.05, "interval": None, "passed": True})
    GateReport.objects.create(version=version, baseline=baseline, passed=True, checks=checks,
                              policy={"kl_max": 0.05})
    if version.state in (VersionState.RETIRED, VersionState.PRODUCTION):
        snapshot = {"version_id": version.id, "number": version.number}
        AuditLog.objects.create(project=project, actor="seed", action="approve", target=f"policy_version:{version.id}",
                                before={**snapshot, "state": "awaiting_approval"},
                                after={**snapshot, "state": "production"}, reason="seed_load: gate passed")
