"""Dashboard pages: status and permissions per role, bounded query counts, the approval form."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from feedback.models import Trajectory
from training.models import AuditLog, PolicyVersion

pytestmark = pytest.mark.django_db

PAGES = ["overview", "runs", "rubrics", "rollouts", "replay", "registry", "data"]


def _seed(slug: str, events: int, trajectories: int) -> None:
    call_command("seed_load", events=events, trajectories=trajectories, project=slug, run_steps=30, stdout=None)


@pytest.fixture
def loaded(creds):
    _seed(creds.project.slug, 200, 40)
    return creds.project


def _url(page: str, slug: str) -> str:
    if page == "replay":
        t = Trajectory.objects.filter(project__slug=slug, steps__routing__isnull=False).order_by("id").first()
        t = t or Trajectory.objects.filter(project__slug=slug).order_by("id").first()
        return f"/p/{slug}/rollouts/{t.id}/?task={t.task}"
    return f"/p/{slug}/" if page == "overview" else f"/p/{slug}/{page}/"


def _client(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.mark.parametrize("page", PAGES)
def test_members_see_every_page(page, loaded, alice, bob):
    for user in (alice, bob):
        response = _client(user).get(_url(page, loaded.slug))
        assert response.status_code == 200, (page, user)
        assert b'data-project="acme"' in response.content


@pytest.mark.parametrize("page", [*PAGES, "index"])
def test_an_outsider_gets_404_and_anonymous_a_login_redirect(page, loaded, charlie):
    url = "/" if page == "index" else _url(page, loaded.slug)
    response = _client(charlie).get(url)
    if page == "index":  # the front page lists only one's own projects: none
        assert response.status_code == 200 and b"acme" not in response.content
        assert b"member of no project" in response.content
    else:  # the same page as for a project that does not exist
        assert response.status_code == 404 and b"there is no project" in response.content.lower()
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")


def test_an_unknown_project_is_a_404_page_that_says_what_to_do(bob):
    response = _client(bob).get("/p/nope/")
    assert response.status_code == 404 and b"there is no project" in response.content.lower()


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("page", [*PAGES, "index"])
def test_query_count_is_bounded_and_independent_of_row_count(page, loaded, bob, django_assert_max_num_queries):
    client = _client(bob)
    url = "/" if page == "index" else _url(page, loaded.slug)
    with django_assert_max_num_queries(25):  # the overview: 20 (tests/webapp/test_overview_rollups.py counts them)
        assert client.get(url).status_code == 200
    small = _queries(client, url)
    _seed(loaded.slug, 3000, 400)
    assert _queries(client, url) == small


def test_overview_shows_plots_versions_run_and_queues(loaded, bob):
    body = _client(bob).get(f"/p/{loaded.slug}/").content.decode()
    for marker in ('data-figure="volume"', 'data-figure="rate"', 'data-figure="reward"', "/vendor/plotly.min.js",
                   'data-version-state="6"', "data-run-progress=", "Queues", "judge failures"):
        assert marker in body, marker
    assert 'id="figures"' in body and '"v7"' in body  # the version marks on the time axis


def test_runs_page_compares_two_runs(loaded, bob):
    from training.models import TrainingRun

    a, b = TrainingRun.objects.filter(project=loaded).order_by("id")[:2]
    body = _client(bob).get(f"/p/{loaded.slug}/runs/?run={a.id}&compare={b.id}").content.decode()
    assert f"run {a.id}" in body and f"run {b.id}" in body
    for metric in ("loss", "kl_ref", "entropy", "clip_fraction", "mismatch_kl", "staleness_kl", "grad_norm", "reward_mean",
                   "tokens_per_s"):
        assert f'data-figure="{metric}"' in body


def test_rubric_filters_narrow_the_rollups(loaded, bob):
    client = _client(bob)
    everything = client.get(f"/p/{loaded.slug}/rubrics/").context["figures"]["boxes"]["data"]
    assert {b["name"] for b in everything} == {"correctness", "style", "helpfulness"}
    response = client.get(f"/p/{loaded.slug}/rubrics/?task=no-such-task&tag=ide")
    assert response.status_code == 200 and response.context["figures"]["boxes"]["data"] == []


def test_replay_shows_tokens_routing_group_and_neighbours(loaded, bob):
    response = _client(bob).get(_url("replay", loaded.slug))
    body = response.content.decode()
    assert body.count('<span class="tok') == 16 and "hsl(" in body
    assert any(k.startswith("routing-") for k in response.context["figures"])
    assert len(response.context["group"]) == 4
    assert response.context["prev"] or response.context["next"]


def test_viewer_sees_no_decision_buttons_and_approver_does(loaded, alice, bob):
    assert b">Approve</button>" not in _client(bob).get(f"/p/{loaded.slug}/registry/").content
    assert b">Approve</button>" in _client(alice).get(f"/p/{loaded.slug}/registry/").content


def test_a_viewer_cannot_approve(loaded, bob):
    response = _client(bob).post(f"/p/{loaded.slug}/registry/v8/approve/", {"reason": "looks good"})
    assert response.status_code == 403
    assert PolicyVersion.objects.get(project=loaded, number=8).state == "awaiting_approval"


def test_approval_needs_a_reason_and_a_csrf_token(loaded, alice):
    assert _client(alice).post(f"/p/{loaded.slug}/registry/v8/approve/", {"reason": " "}).status_code == 400
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    assert strict.post(f"/p/{loaded.slug}/registry/v8/approve/", {"reason": "ok"}).status_code == 403
    assert PolicyVersion.objects.get(project=loaded, number=8).state == "awaiting_approval"


def test_an_approver_approves_with_a_reason_and_it_is_audited(loaded, alice):
    response = _client(alice).post(f"/p/{loaded.slug}/registry/v8/approve/", {"reason": "gate passed, evals fine"})
    assert response.status_code == 302
    assert PolicyVersion.objects.get(project=loaded, number=8).state == "production"
    entry = AuditLog.objects.filter(project=loaded, action="approve").order_by("-id").first()
    assert entry.actor == "alice" and entry.reason == "gate passed, evals fine"
    body = _client(alice).get(f"/p/{loaded.slug}/registry/").content.decode()
    assert "gate passed, evals fine" in body


def test_what_was_live_at_a_time(loaded, bob):
    from datetime import timedelta

    from django.utils import timezone

    at = (timezone.now() + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")  # after the seed's approvals
    assert _client(bob).get(f"/p/{loaded.slug}/registry/?at=2000-01-01T00:00").context["live_at"] is None
    response = _client(bob).get(f"/p/{loaded.slug}/registry/?at={at}")
    assert response.status_code == 200 and response.context["live_at"].number == 6
    assert _client(bob).get(f"/p/{loaded.slug}/registry/?at=yesterday").status_code == 400


def test_plotly_is_served_locally(client):
    response = client.get("/vendor/plotly.min.js")
    assert response.status_code == 200 and response["Content-Type"] == "application/javascript"
    assert b"plotly" in b"".join(response.streaming_content)[:2000].lower()


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_an_outsider_cannot_subscribe_to_live_events(charlie, creds):
    from asgiref.sync import sync_to_async
    from channels.testing import WebsocketCommunicator

    from webapp.asgi import application

    client = Client()
    await sync_to_async(client.force_login)(charlie)
    communicator = WebsocketCommunicator(
        application, f"/ws/projects/{creds.project.slug}/",
        headers=[(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost")])
    connected, code = await communicator.connect()
    assert not connected and code == 4404


def test_the_rubric_page_shows_the_users_reward_model_per_run(creds, bob):
    from training.models import TrainingRun

    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    model = {"checks": ["python_compiles"], "labels": 812, "accept_rate": 0.25, "heldout": 163,
             "heldout_auc": 0.971, "heldout_log_loss": 0.142, "base_rate_log_loss": 0.566,
             "heldout_mean_predicted": 0.27, "heldout_mean_observed": 0.26}
    run = TrainingRun.objects.create(project=creds.project, base_version=v1, state="succeeded",
                                     result={"reward_model": model, "rollouts": 512})
    TrainingRun.objects.create(project=creds.project, base_version=v1, state="succeeded")
    body = _client(bob).get(f"/p/{creds.project.slug}/rubrics/").content.decode()
    table = body[body.index('id="reward-model"'):]
    assert f"?run={run.id}" in table and "812" in table and "0.971" in table and "0.142 (0.566)" in table
    assert table.count("<tr>") == 2  # the header and the one run that fitted a model


def test_the_rubric_page_tells_a_context_model_from_the_feature_fallback(creds, bob):
    from training.models import TrainingRun

    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    model = {"kind": "context", "checks": [], "labels": 2000, "accept_rate": 0.5, "heldout": 400,
             "heldout_auc": 0.812, "features_heldout_auc": 0.507}
    TrainingRun.objects.create(project=creds.project, base_version=v1, state="succeeded",
                               result={"reward_model": model, "rollouts": 64})
    body = _client(bob).get(f"/p/{creds.project.slug}/rubrics/").content.decode()
    table = body[body.index('id="reward-model"'):]
    assert "<td>context</td><td>2000</td>" in table and "0.812 (0.507)" in table


def test_the_rubric_page_shows_how_graded_signals_scale_their_reward(creds, bob):
    from training.rewards.services import reward_spec_update

    reward_spec_update(creds.project, signal_rewards={"accept": {"reward": 0.75, "value": "chars", "scale": 40},
                                                      "edit_kept": {"reward": 0.5, "value": "fraction"}})
    body = _client(bob).get(f"/p/{creds.project.slug}/rubrics/").content.decode()
    table = body[body.index('id="signal-rewards"'):body.index('id="reward-model"')]
    assert "<td>accept</td><td>0.750</td><td>x min(chars, 40) / 40</td>" in table
    assert "<td>edit_kept</td><td>0.500</td><td>x kept fraction</td>" in table
    assert "<td>reject</td><td>-0.250</td><td>-</td>" in table
