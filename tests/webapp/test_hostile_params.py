"""No input yields a 500: every malformed query or path value on the dashboard and the read API is
a 400 that says how to fix it (core/params.py), and the properties hold for any text (Hypothesis)."""

from __future__ import annotations

import base64
from urllib.parse import quote, urlencode

import pytest
from django.test import Client
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from feedback.services import feedback_ingest
from tests.factories import trajectory

pytestmark = pytest.mark.django_db
HYPOTHESIS = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _member(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _fixed(response) -> str:
    return response.content.decode()


@pytest.mark.parametrize(("page", "query", "words"), [
    ("", "days=²", "whole number"),
    ("", "days=" + "9" * 5000, "whole number"),
    ("", "days=0", "between 1 and 90"),
    ("registry/", "at=2026-02-30T00:00", "calendar"),
    ("registry/", "at=9999-12-31T23:59:59-23:59", "calendar"),
    ("rubrics/", "task=%00", "NUL"),
    ("rubrics/", "tag=%00", "NUL"),
    ("rollouts/", "task=%00", "NUL"),
    ("rollouts/", "signal=%00", "NUL"),
    ("rollouts/", "version=¹", "whole number"),
    ("rollouts/", "reward_min=nan", "finite number"),
    ("runs/", "run=" + "1" * 40, "whole number"),
    ("runs/", "compare=%C2%B2", "whole number"),
])
def test_a_malformed_dashboard_query_is_a_400_with_its_fix(alice, creds, page, query, words):
    response = _member(alice).get(f"/p/{creds.project.slug}/{page}?{query}")
    assert response.status_code == 400, (page, query)
    assert words in _fixed(response)


def test_a_nul_in_the_replay_query_is_a_400(alice, creds):
    feedback_ingest(creds.project, [trajectory("t-1")])
    from feedback.models import Trajectory

    tid = Trajectory.objects.get(external_id="t-1").id
    assert _member(alice).get(f"/p/{creds.project.slug}/rollouts/{tid}/?task=%00").status_code == 400


def test_a_decision_reason_with_a_nul_is_a_400(alice, creds):
    from training.models import PolicyVersion

    PolicyVersion.objects.create(project=creds.project, number=1, state="awaiting_approval", checkpoint_path="/x")
    response = _member(alice).post(f"/p/{creds.project.slug}/registry/v1/approve/", {"reason": "ok\x00"})
    assert response.status_code == 400 and "NUL" in _fixed(response)


def _read(client, key: str, url: str):
    return client.get(url, HTTP_AUTHORIZATION=f"Bearer {key}")


def _cursor(**tokens: str) -> str:
    return quote(base64.b64encode(urlencode(tokens).encode()).decode())


@pytest.mark.parametrize("cursor", [_cursor(p="not-a-date"), _cursor(p="2026-02-30 00:00:00+00:00"),
                                    _cursor(p="\x00"), _cursor(o="-1"), _cursor(r="x"), "\u00e9t\u00e9"])
def test_a_forged_cursor_is_a_400_with_its_fix(client, creds, cursor):
    feedback_ingest(creds.project, [trajectory("t-1")])
    response = _read(client, creds.api_key, f"/api/v1/trajectories?cursor={cursor}")
    assert response.status_code == 400, response.content
    assert "next" in response.json()["error"]["fix"]


def test_a_cursor_this_api_gave_still_works(client, creds):
    feedback_ingest(creds.project, [trajectory(f"t-{i}", occurred_at=f"2026-11-29T08:0{i}:00Z") for i in range(4)])
    page = _read(client, creds.api_key, "/api/v1/trajectories?limit=2").json()
    following = _read(client, creds.api_key, page["next"])
    assert following.status_code == 200 and [t["id"] for t in following.json()["results"]] == ["t-1", "t-0"]


def test_a_nul_in_a_trajectory_id_path_is_a_400(client, creds):
    response = _read(client, creds.api_key, "/api/v1/trajectories/t%00x")
    assert response.status_code == 400 and "NUL" in response.json()["error"]["message"]


@pytest.mark.parametrize("url", ["/api/v1/trajectories?project=%00", "/api/v1/versions?project=%00",
                                 "/api/v1/export?format=messages&project=" + "x" * 5000])
def test_a_session_naming_an_impossible_project_gets_the_404_of_a_missing_one(alice, url):
    response = _member(alice).get(url)
    assert response.status_code == 404 and "there is no project" in response.json()["error"]["message"]


_QUERY_NAMES = ["days", "at", "task", "tag", "run", "compare", "version", "signal", "source", "reward_min",
                "reward_max"]


@HYPOTHESIS
@given(name=st.sampled_from(_QUERY_NAMES), value=st.text(max_size=300),
       page=st.sampled_from(["", "runs/", "rubrics/", "rollouts/", "registry/"]))
def test_no_dashboard_query_value_is_a_5xx(alice, creds, name, value, page):
    response = _member(alice).get(f"/p/{creds.project.slug}/{page}", {name: value})
    assert response.status_code in (200, 400), (name, value, response.status_code)


@HYPOTHESIS
@given(cursor=st.one_of(st.text(max_size=200),
                        st.dictionaries(st.sampled_from(["o", "r", "p"]), st.text(max_size=60), max_size=3)
                        .map(lambda d: base64.b64encode(urlencode(d).encode()).decode())))
def test_no_cursor_is_a_5xx(client, creds, cursor):
    response = client.get("/api/v1/trajectories", {"cursor": cursor}, HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert response.status_code in (200, 400), (cursor, response.status_code)


@HYPOTHESIS
@given(external_id=st.text(min_size=1, max_size=300))
def test_no_trajectory_id_path_is_a_5xx(client, creds, external_id):
    response = client.get("/api/v1/trajectories/" + quote(external_id, safe=""),
                          HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert response.status_code in (400, 404), (external_id, response.status_code)
