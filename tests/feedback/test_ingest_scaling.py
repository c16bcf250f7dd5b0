"""Look-ups by a project's own ids cost what they look up, not the size of the project or of the
deployment: the ones that link feedback to its trajectory (and a late trajectory to the feedback
that came first) probe an index per event, and a trajectory read by its id probes the unique
index, whatever the planner's statistics say.

The statistics are made stale on purpose, as they are for a project that grew after the last
ANALYZE (autovacuum analyses a table only after a tenth of it changed): the planner then takes the
big project for an empty one. Each test counts the pages the batch's statements read from the
looked-up table (EXPLAIN ANALYZE, BUFFERS) and bounds them by the batch."""

from __future__ import annotations

import pytest
from django.db import connection

from feedback.models import Project
from feedback.services import feedback_ingest, project_create
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db

BIG = 20_000  # rows already in the looked-up table
BATCH = 20
PAGES_PER_PROBE = 4  # an index descent (root, inner, leaf) and the heap page


def _planned(statements: tuple[str, ...]):
    """Wraps the connection: each statement starting with one of `statements` is first run under
    EXPLAIN (ANALYZE, BUFFERS) in a savepoint that is rolled back, then for real."""
    plans: list[dict] = []

    def wrapper(execute, sql, params, many, context):
        if sql.lstrip().startswith(statements):
            cur = context["cursor"]
            cur.execute("SAVEPOINT explained")
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
            plans.append(cur.fetchone()[0][0]["Plan"])
            cur.execute("ROLLBACK TO SAVEPOINT explained")
        return execute(sql, params, many, context)

    return wrapper, plans


def _pages_scanned(plan: dict, relation: str) -> int:
    """Pages (shared buffers hit or read) the plan's scans of `relation` touched."""
    own = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] if (
        "Scan" in plan["Node Type"] and plan.get("Relation Name") == relation) else 0
    return own + sum(_pages_scanned(child, relation) for child in plan.get("Plans", []))


_TRAJECTORIES = """
INSERT INTO feedback_trajectory (project_id, external_id, policy_version, source, task, tags, prompt, extra,
                                 occurred_at, received_at, user_hash, no_train)
SELECT %(project)s, %(prefix)s || g, 1, 'live', '', '[]', '[]', '{}', now(), now(), '', false
FROM generate_series(1, %(n)s) AS g
"""

_FEEDBACK = """
INSERT INTO feedback_feedbackevent (project_id, event_id, trajectory_external_id, trajectory_id, signal, user_hash,
                                    extra, occurred_at, received_at, no_train)
SELECT %(project)s, %(prefix)s || g, 'never-' || g,
       (SELECT min(id) FROM feedback_trajectory WHERE project_id = %(project)s AND %(linked)s),
       'accept', '', '{}', now(), now(), false
FROM generate_series(1, %(n)s) AS g
"""


def _stale_trajectories(project: Project) -> None:
    """BIG trajectories of `project` (old-1 .. old-BIG) that the statistics know nothing of: the
    table was analysed while it held only a small project's rows."""
    small = project_create("small").project
    with connection.cursor() as cur:
        cur.execute(_TRAJECTORIES, {"project": small.id, "prefix": "small-", "n": 500})
        cur.execute("ANALYZE feedback_trajectory")
        cur.execute(_TRAJECTORIES, {"project": project.id, "prefix": "old-", "n": BIG})


def test_feedback_finds_its_trajectory_with_a_probe_per_event_in_a_big_project(creds):
    project = Project.objects.get(pk=creds.project.pk)
    _stale_trajectories(project)
    events = [feedback(f"f-{i}", f"old-{i * 997 % BIG + 1}") for i in range(BATCH)]
    wrapper, plans = _planned(("INSERT INTO feedback_feedbackevent",))
    with connection.execute_wrapper(wrapper):
        results = feedback_ingest(project, events)
    assert {r.status for r in results} == {"accepted"}
    assert project.feedback_events.filter(trajectory__isnull=False).count() == BATCH  # every one linked
    (plan,) = plans
    assert _pages_scanned(plan, "feedback_trajectory") <= BATCH * PAGES_PER_PROBE


def test_a_late_trajectory_finds_its_feedback_without_reading_other_projects_orphans(creds):
    project = Project.objects.get(pk=creds.project.pk)
    elsewhere = project_create("elsewhere").project  # its feedback's trajectories never come
    with connection.cursor() as cur:  # linked feedback analysed, then the orphans
        cur.execute(_TRAJECTORIES, {"project": elsewhere.id, "prefix": "seen-", "n": 1})
        cur.execute(_FEEDBACK, {"project": elsewhere.id, "prefix": "linked-", "n": 500, "linked": True})
        cur.execute("ANALYZE feedback_feedbackevent")
        cur.execute(_FEEDBACK, {"project": elsewhere.id, "prefix": "orphan-", "n": BIG, "linked": False})
    feedback_ingest(project, [feedback(f"early-{i}", f"t-{i}") for i in range(BATCH // 2)])  # before its trajectory
    wrapper, plans = _planned(("WITH t AS (",))
    with connection.execute_wrapper(wrapper):
        results = feedback_ingest(project, [trajectory(f"t-{i}") for i in range(BATCH)])
    assert {r.status for r in results} == {"accepted"}
    assert project.feedback_events.filter(trajectory__isnull=True).count() == 0  # the early ones linked
    (plan,) = plans
    assert _pages_scanned(plan, "feedback_feedbackevent") <= BATCH * PAGES_PER_PROBE


def test_the_orphan_safety_net_links_by_probes_not_by_reading_the_project(creds):
    from feedback.services import feedback_link_orphans

    project = Project.objects.get(pk=creds.project.pk)
    feedback_ingest(project, [feedback(f"early-{i}", f"old-{i * 997 % BIG + 1}") for i in range(BATCH)])
    _stale_trajectories(project)
    wrapper, plans = _planned(("UPDATE feedback_feedbackevent",))
    with connection.execute_wrapper(wrapper):
        assert feedback_link_orphans(project) == BATCH
    assert project.feedback_events.filter(trajectory__isnull=True).count() == 0
    (plan,) = plans
    assert _pages_scanned(plan, "feedback_trajectory") <= BATCH * PAGES_PER_PROBE


def test_a_trajectory_read_by_its_id_probes_the_unique_index_in_a_big_project(creds, client):
    project = Project.objects.get(pk=creds.project.pk)
    _stale_trajectories(project)
    wrapper, plans = _planned(('SELECT "feedback_trajectory"."id"',))
    with connection.execute_wrapper(wrapper):
        response = client.get(f"/api/v1/trajectories/old-{BIG // 2}", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert response.status_code == 200 and response.json()["id"] == f"old-{BIG // 2}"
    (plan,) = plans
    assert _pages_scanned(plan, "feedback_trajectory") <= PAGES_PER_PROBE
