"""The dashboard tells the truth about usefulness: accepted characters and invented names per
version, what each version writes now, run settings as JSON, audit rows as field changes, and the
simulated users' aspect labels on the rubric page."""

from __future__ import annotations

import html
import json
import random

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from tests.factories import feedback, trajectory
from training.models import AuditLog, PolicyVersion, TrainingRun
from webapp.rollups import rollups_refresh

pytestmark = pytest.mark.django_db

PROMPT = "def add(a, b):\n    total = a + b\n    return"


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _served(ident: str, completion: str, version: int = 1) -> dict:
    return trajectory(ident, policy_version=version, prompt=[{"role": "user", "content": PROMPT}],
                      steps=[{"role": "assistant", "content": completion}])


@pytest.fixture
def served(creds, post_events):
    for number, state in ((1, "production"), (2, "awaiting_approval")):
        PolicyVersion.objects.create(project=creds.project, number=number, state=state)
    post_events([_served("t-1", " total"), _served("t-2", " zorblax(a)"), _served("t-3", " tot"),
                 _served("t-4", "   "), _served("t-5", " total", version=2),
                 feedback("f-1", "t-1", "accept", value=6), feedback("f-2", "t-2", "reject"),
                 feedback("f-3", "t-3", "accept", value=4), feedback("f-5", "t-5", "accept", value=6)])
    rollups_refresh()  # what beat does every minute: these hours are older than the overview's raw two
    return creds.project


def test_the_overview_shows_accepted_characters_and_invented_names_per_version(served, bob):
    body = _client(bob).get(f"/p/{served.slug}/").content.decode()
    row = body[body.index('<tr data-version="1">'):]
    row = row[:row.index("</tr>")]
    # v1 served four suggestions: 6 + 4 characters kept (the silent one counts as a request)
    assert "<td data-accepted-chars>2.50</td>" in row
    # of its three shown suggestions one writes a name that is neither in the users' code nor Python
    assert "<td data-invented-share>0.333</td>" in row
    v2 = body[body.index('<tr data-version="2">'):]
    assert "<td data-accepted-chars>6.00</td>" in v2[:v2.index("</tr>")]


def test_what_it_writes_now_lists_recent_suggestions_per_version_with_their_clicks(served, bob):
    body = _client(bob).get(f"/p/{served.slug}/").content.decode()
    panel = body[body.index('data-writes-version="1"'):]
    panel = panel[:panel.index("</table>")]
    assert "<code> zorblax(a)</code>" in panel and "reject" in panel and "accept 6" in panel
    assert "(nothing shown)" in panel  # the silent suggestion, shown as such
    assert panel.count("<tr>") == 5  # the header and its four suggestions, newest first
    assert 'data-writes-version="2"' in body


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


def test_the_overview_query_count_does_not_grow_with_the_suggestions(served, bob, post_events):
    client = _client(bob)
    few = _queries(client, f"/p/{served.slug}/")
    post_events([_served(f"more-{i}", " total", version=1 + i % 2) for i in range(150)]
                + [feedback(f"fm-{i}", f"more-{i}", "accept", value=6) for i in range(150)])
    assert _queries(client, f"/p/{served.slug}/") == few


def test_run_settings_render_as_readable_json(creds, bob):
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    run = TrainingRun.objects.create(project=creds.project, base_version=v1, state="succeeded",
                                     settings={"rl": {"lr": 0.002, "kl_to": "production"}, "group": {"G": 8}})
    body = _client(bob).get(f"/p/{creds.project.slug}/runs/?run={run.id}").content.decode()
    shown = body[body.index("<pre data-run-settings>") + len("<pre data-run-settings>"):]
    shown = html.unescape(shown[:shown.index("</pre>")])
    # indented, keys sorted, valid JSON (not a Python repr)
    assert shown == '{\n  "group": {\n    "G": 8\n  },\n  "rl": {\n    "kl_to": "production",\n    "lr": 0.002\n  }\n}'
    assert json.loads(shown) == run.settings


def test_audit_rows_show_each_changed_field_before_and_after(creds, bob):
    AuditLog.objects.create(project=creds.project, actor="alice", action="approve", target="v8",
                            before={"number": 8, "state": "awaiting_approval"},
                            after={"number": 8, "state": "production", "approved_by": "alice"}, reason="gate passed")
    AuditLog.objects.create(project=creds.project, actor="system", action="create", target="v9", before=None,
                            after={"number": 9})
    body = _client(bob).get(f"/p/{creds.project.slug}/registry/").content.decode()
    audit = body[body.index('id="audit"'):]
    assert '<li data-field="state"><code>state</code>: awaiting_approval → production</li>' in audit
    assert '<li data-field="approved_by"><code>approved_by</code>: – → alice</li>' in audit
    assert '<li data-field="number"><code>number</code>: – → 9</li>' in audit
    assert audit.count('data-field="number"') == 1  # v8's number did not change: not listed


def test_the_simulated_users_aspect_labels_reach_the_judge_vs_human_agreement(creds, post_events, bob):
    """The demo's users label one suggestion in ten; their labels and the spec's judge meet on the
    rubric page once the rewards are computed and the rollups refreshed."""
    from feedback.models import Trajectory
    from training.rewards.services import reward_spec_current, rewards_compute
    from webapp.demo.simulator import UserPrompt, _feedback_events
    from webapp.rollups import rollups_refresh

    PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    rng, events = random.Random(4), []
    for i in range(80):
        events += [_served(f"t-{i}", " total")]
        events += _feedback_events({"trajectory_id": f"t-{i}", "text": " total"},
                                   UserPrompt(PROMPT, " total"), rng, "intent", 0.05)
    assert post_events(events).status_code == 202
    rewards_compute(Trajectory.objects.filter(project=creds.project).values_list("pk", flat=True),
                    reward_spec_current(creds.project))
    rollups_refresh()
    response = _client(bob).get(f"/p/{creds.project.slug}/rubrics/")
    pairs = {a["aspect"]: a["pairs"] for a in response.context["agreement"]}
    assert pairs.get("style", 0) >= 3 and pairs.get("concision", 0) >= 3, pairs
