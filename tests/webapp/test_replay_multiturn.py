"""The replay of an agent trajectory: tool calls and results, the summary turn where the context
was compacted, which turns were trained and each one's return and advantage (hand-computed), in
the page and in a real browser (the screenshot docs/screenshots/replay-multiturn.png comes from
FLYWHEEL_SCREENSHOT_DIR=docs/screenshots).

    .venv/bin/python -m pytest tests/webapp/test_replay_multiturn.py -q
"""

from __future__ import annotations

import pytest
from django.test import Client
from playwright.sync_api import expect, sync_playwright

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from tests.training.test_services import later, plain_spec
from tests.webapp.test_dashboard_browser import ARGS, CHROMIUM, _login, _shot
from training.rewards.services import rewards_compute_pending

CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "calc.py"}'}}


def _agent(creds) -> int:
    """Two rollouts of one task: r-1 accepted (0.75) with a step reward of 0.5 on its summary,
    r-2 rejected (-0.25). Group mean return (1.25 - 0.25) / 2 = 0.5."""
    plain_spec(creds.project, settle_seconds=0)
    prompt = [{"role": "user", "content": "Make the tests in test_task.py pass by fixing calc.py."}]
    feedback_ingest(creds.project, [
        trajectory("r-1", task="agent:add", group="g-1", prompt=prompt, steps=[
            {"role": "assistant", "content": "Reading it. ", "tool_calls": [CALL], "token_ids": [5, 6],
             "logprobs": [-0.5, -0.25], "tokens": ["Read", "ing"]},
            {"role": "tool", "content": "def add(a, b):\n    return a - b\n", "tool_call_id": "call_1"},
            {"role": "user", "content": "Summarize the task, what you did and what is left, briefly."},
            {"role": "assistant", "content": "Summary: add subtracts; fix it.", "summary": True, "reward": 0.5},
            {"role": "assistant", "content": "Fixed: add returns a + b."},
        ]),
        trajectory("r-2", task="agent:add", group="g-1", prompt=prompt,
                   steps=[{"role": "assistant", "content": "No idea."}]),
        feedback("fb-1", "r-1", signal="accept"), feedback("fb-2", "r-2", signal="reject"),
    ])
    rewards_compute_pending(creds.project, now=later(1))
    return Trajectory.objects.get(external_id="r-1").pk


def test_the_replay_marks_trained_turns_with_their_return_and_advantage(creds, bob):
    pk = _agent(creds)
    client = Client()
    client.force_login(bob)
    response = client.get(f"/p/{creds.project.slug}/rollouts/{pk}/")
    assert response.status_code == 200
    turns = [v.turn for v in response.context["steps"]]
    assert [t and t["index"] for t in turns] == [0, None, None, 1, 2]
    assert [t["return"] for t in turns if t] == [1.25, 1.25, 0.75]
    assert [t["advantage"] for t in turns if t] == [0.75, 0.75, 0.25]
    body = response.content.decode()
    assert body.count('data-turn="') == 3 and body.count("context (not trained)") == 2
    assert "context compacted here" in body and "read_file({&quot;path&quot;: &quot;calc.py&quot;})" in body
    assert "result of <code>call_1</code>" in body


@pytest.mark.django_db(transaction=True)
def test_the_multi_turn_replay_in_a_browser(creds, alice, asgi_server):
    pk = _agent(creds)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = _login(browser, asgi_server, "alice", "alice-password-1", f"/p/{creds.project.slug}/rollouts/{pk}/",
                          viewport={"width": 1280, "height": 900})
            expect(page.locator(".msg.trained")).to_have_count(3)
            expect(page.locator(".compacted")).to_be_visible()
            expect(page.locator("pre.tool-call")).to_contain_text("read_file")
            _shot(page, "replay-multiturn")
        finally:
            browser.close()
