"""The dashboard in a real browser (Playwright driving Debian's chromium) against uvicorn:
log in, charts render, a live ingest push updates the page without a reload, a rollout replays,
an approver approves a version and a viewer sees no button. Screenshots go to var/screenshots/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from django.core.management import call_command
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.factories import feedback, sign, trajectory

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]
# Written under var/ so test runs leave the checkout clean; FLYWHEEL_SCREENSHOT_DIR=docs/screenshots
# refreshes the README's pictures.
SHOTS = Path(os.environ.get("FLYWHEEL_SCREENSHOT_DIR", Path(__file__).resolve().parents[2] / "var" / "screenshots"))


@pytest.fixture
def loaded(creds, alice, bob):
    call_command("seed_load", events=2000, trajectories=200, project=creds.project.slug, run_steps=60, stdout=None)
    return creds


@pytest.fixture
def browser(loaded, asgi_server):
    # Started after every database fixture: Playwright's sync API runs an event loop in this
    # thread, and Django refuses ORM calls while one runs.
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield browser
        browser.close()


def _login(browser: Browser, base: str, username: str, password: str, path: str, **context) -> Page:
    page = browser.new_context(**context).new_page()
    page.set_default_timeout(20_000)
    page.goto(base + path)
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(base + path)
    return page


def _ingest(base: str, creds) -> None:
    events = [trajectory("t-browser", policy_version=6), feedback("fb-b1", "t-browser"),
              feedback("fb-b2", "t-browser", signal="happy")]
    body = json.dumps({"events": events})
    headers = {**sign(creds.webhook_secret, body), "flywheel-project": creds.project.slug,
               "content-type": "application/json"}
    assert httpx.post(base + "/api/v1/events", content=body, headers=headers, timeout=10).status_code == 202


def _shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_the_dashboard_in_a_browser(asgi_server, loaded, browser):
    creds, slug = loaded, loaded.project.slug
    page = _login(browser, asgi_server, "alice", "alice-password-1", f"/p/{slug}/",
                  viewport={"width": 1280, "height": 900})
    for name in ("volume", "rate", "reward"):
        expect(page.locator(f'[data-figure="{name}"] .main-svg').first).to_be_visible()
    expect(page.locator("body")).to_have_attribute("data-live", "on")
    _shot(page, "overview")

    _ingest(asgi_server, creds)
    expect(page.locator("#live-feedback")).to_have_text("2")
    expect(page.locator("#live-trajectories")).to_have_text("1")
    assert page.evaluate("document.querySelector('[data-figure=volume]').data.at(-1).y.length") == 1

    page.goto(f"{asgi_server}/p/{slug}/runs/")
    expect(page.locator('[data-figure="loss"] .main-svg').first).to_be_visible()
    _shot(page, "runs")
    page.goto(f"{asgi_server}/p/{slug}/rubrics/")
    expect(page.locator('[data-figure="boxes"] .main-svg').first).to_be_visible()
    _shot(page, "rubrics")

    page.goto(f"{asgi_server}/p/{slug}/rollouts/?task=tab-completion")
    page.locator("a.rollout").first.click()
    expect(page.locator("span.tok").first).to_be_visible()
    assert page.locator("span.tok").count() >= 3
    page.locator("#next").click()
    expect(page.locator("span.tok").first).to_be_visible()
    assert "task=tab-completion" in page.url
    _shot(page, "replay")

    page.goto(f"{asgi_server}/p/{slug}/registry/")
    row = page.locator("#v8")
    expect(row.locator("[data-version-state]")).to_have_text("awaiting_approval")
    row.locator("input[name=reason]").fill("gate passed; evals look fine")
    row.get_by_role("button", name="Approve").click()
    expect(page.locator("#v8 [data-version-state]")).to_have_text("production")
    expect(page.locator("#audit")).to_contain_text("gate passed; evals look fine")
    _shot(page, "registry")

    viewer = _login(browser, asgi_server, "bob", "bob-password-1", f"/p/{slug}/registry/",
                    viewport={"width": 390, "height": 844}, is_mobile=True)
    expect(viewer.locator("#v8 [data-version-state]")).to_have_text("production")
    assert viewer.get_by_role("button", name="Approve").count() == 0
    _shot(viewer, "registry-phone")
