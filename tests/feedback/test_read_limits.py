"""What one read may cost: the read API's pages are bounded in bytes as well as rows, a long
step's tokens are summarised (the first ones and a count), and the replay page draws at most
REPLAY_MAX_TOKENS tokens and heatmap columns per step.

    .venv/bin/python -m pytest tests/feedback/test_read_limits.py -q
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from tests.factories import trajectory

pytestmark = pytest.mark.django_db


def _get(client, key, url):
    return client.get(url, HTTP_AUTHORIZATION=f"Bearer {key}")


def long_step(n: int, layers: int = 2) -> dict:
    return {"role": "assistant", "content": "x" * 10, "token_ids": [i % 1000 for i in range(n)],
            "logprobs": [-0.5] * n, "routing": [[[i % 8, 1]] * layers for i in range(n)]}


def test_a_long_steps_tokens_are_summarised_and_a_short_ones_are_whole(client, creds, settings):
    settings.READ_MAX_TOKENS_PER_STEP = 100
    feedback_ingest(creds.project, [trajectory("long", steps=[long_step(5000)]), trajectory("short")])

    step = _get(client, creds.api_key, "/api/v1/trajectories/long").json()["steps"][0]
    assert step["token_ids"] == [i % 1000 for i in range(100)]
    assert len(step["logprobs"]) == 100 and len(step["routing"]) == 100
    assert step["token_count"] == 5000 and step["tokens_truncated"] is True
    short = _get(client, creds.api_key, "/api/v1/trajectories/short").json()["steps"][0]
    assert short["token_ids"] == [17, 92, 5] and short["token_count"] == 3 and short["tokens_truncated"] is False
    listed = _get(client, creds.api_key, "/api/v1/trajectories").json()["results"]
    assert {t["id"]: len(t["steps"][0]["token_ids"]) for t in listed} == {"long": 100, "short": 3}


def test_a_page_ends_at_its_byte_budget_and_the_cursor_continues_after_it(client, creds, settings):
    events = [trajectory(f"t-{i:02d}", occurred_at=f"2026-11-29T08:{i:02d}:00Z",
                         steps=[{"role": "assistant", "content": "y" * 3000}]) for i in range(10)]
    events.append(trajectory("same-minute", occurred_at="2026-11-29T08:05:00Z",
                             steps=[{"role": "assistant", "content": "z" * 3000}]))
    feedback_ingest(creds.project, events)
    settings.READ_PAGE_MAX_BYTES = 8000  # two ~3.5 KB trajectories per page

    page = _get(client, creds.api_key, "/api/v1/trajectories?limit=500").json()
    pages, seen = 1, [t["id"] for t in page["results"]]
    assert len(page["results"]) == 2 and len(json.dumps(page["results"])) <= 8000
    while page["next"]:
        page = _get(client, creds.api_key, page["next"]).json()
        pages += 1
        seen += [t["id"] for t in page["results"]]
    assert pages == 6 and len(seen) == 11 and len(set(seen)) == 11  # nothing skipped, nothing twice

    settings.READ_PAGE_MAX_BYTES = 100  # smaller than any one trajectory: one per page, never none
    page = _get(client, creds.api_key, "/api/v1/trajectories").json()
    assert len(page["results"]) == 1 and page["next"]


def test_the_replay_page_draws_the_first_tokens_and_says_how_many_more(creds, bob, settings):
    settings.REPLAY_MAX_TOKENS = 50
    feedback_ingest(creds.project, [trajectory("long", steps=[long_step(3000, layers=3)])])
    client = Client()
    client.force_login(bob)
    t = Trajectory.objects.get(project=creds.project, external_id="long")

    response = client.get(f"/p/{creds.project.slug}/rollouts/{t.id}/")
    body = response.content.decode()
    assert response.status_code == 200
    assert body.count('<span class="tok') == 50
    assert 'data-hidden="2950"' in body and "the first 50 of 3000 are shown" in body
    heatmap = response.context["figures"]["routing-0"]
    assert [len(row) for row in heatmap["data"][0]["z"]] == [50, 50, 50]
    assert "first 50 of 3000 tokens" in heatmap["layout"]["title"]["text"]
