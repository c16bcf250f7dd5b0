"""GET /api/v1/trajectories: scope `read`, filters, cursor pagination, bounded queries."""

from __future__ import annotations

import pytest

from feedback.services import api_key_create, feedback_ingest
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db


def _get(client, key, url):
    return client.get(url, HTTP_AUTHORIZATION=f"Bearer {key}")


def _seed(project, n=12):
    events = [trajectory(f"t-{i:02d}", policy_version=i % 3, occurred_at=f"2026-11-29T08:{i:02d}:00Z")
              for i in range(n)]
    events += [feedback(f"f-{i}", f"t-{i:02d}", signal="accept" if i % 2 else "reject") for i in range(n)]
    feedback_ingest(project, events)


def test_it_lists_newest_first_with_steps_and_feedback(client, creds):
    _seed(creds.project)
    body = _get(client, creds.api_key, "/api/v1/trajectories").json()
    ids = [t["id"] for t in body["results"]]
    assert ids == [f"t-{i:02d}" for i in reversed(range(12))]
    first = body["results"][0]
    assert first["steps"][0]["token_ids"] == [17, 92, 5]
    assert first["feedback"][0]["signal"] == "accept"


def test_it_filters_by_version_signal_and_time(client, creds):
    _seed(creds.project)
    by_version = _get(client, creds.api_key, "/api/v1/trajectories?policy_version=2").json()["results"]
    assert {t["policy_version"] for t in by_version} == {2} and len(by_version) == 4
    accepted = _get(client, creds.api_key, "/api/v1/trajectories?signal=accept").json()["results"]
    assert len(accepted) == 6
    window = _get(client, creds.api_key,
                  "/api/v1/trajectories?since=2026-11-29T08:03:00Z&until=2026-11-29T08:05:00Z").json()["results"]
    assert [t["id"] for t in window] == ["t-04", "t-03"]


def test_it_paginates_with_a_cursor(client, creds):
    _seed(creds.project)
    page = _get(client, creds.api_key, "/api/v1/trajectories?limit=5").json()
    seen = [t["id"] for t in page["results"]]
    while page["next"]:
        page = _get(client, creds.api_key, page["next"]).json()
        seen += [t["id"] for t in page["results"]]
    assert len(seen) == 12 and len(set(seen)) == 12


def test_the_list_runs_a_bounded_number_of_queries(client, creds, django_assert_max_num_queries):
    _seed(creds.project, n=40)
    with django_assert_max_num_queries(5):
        assert _get(client, creds.api_key, "/api/v1/trajectories?limit=40").status_code == 200


def test_it_retrieves_one_and_404s_with_a_fix(client, creds):
    _seed(creds.project, n=2)
    assert _get(client, creds.api_key, "/api/v1/trajectories/t-01").json()["id"] == "t-01"
    missing = _get(client, creds.api_key, "/api/v1/trajectories/nope")
    assert missing.status_code == 404 and missing.json()["error"]["fix"]


def test_it_needs_the_read_scope_and_hides_other_projects(client, creds, other_creds):
    _seed(creds.project, n=2)
    ingest_only = api_key_create(creds.project, ["ingest"])
    assert _get(client, ingest_only, "/api/v1/trajectories").status_code == 403
    assert _get(client, other_creds.api_key, "/api/v1/trajectories").json()["results"] == []
    assert client.get("/api/v1/trajectories").status_code == 401


def test_bad_filters_say_which_field(client, creds):
    response = _get(client, creds.api_key, "/api/v1/trajectories?policy_version=abc")
    assert response.status_code == 400
    assert "policy_version" in response.json()["error"]["fields"]


def test_the_openapi_schema_and_docs_are_served(client, creds):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200 and b"/api/v1/events" in schema.content
    assert client.get("/api/docs/").status_code == 200
