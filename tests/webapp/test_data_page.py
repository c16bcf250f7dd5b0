"""The dashboard's Data page and the lineage panels of the replay and registry pages.

    .venv/bin/python -m pytest tests/webapp/test_data_page.py -q
"""

from __future__ import annotations

from django.test import Client

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from feedback.userdata.services import consent_opt_out_set, data_policy_set
from tests.factories import trajectory

# The training fixtures (a tiny policy in production) for the lineage panels.
from tests.training.conftest import checkpoint_root, ckpt_settings, production, tiny_policy_dir, tokenizer  # noqa: F401
from tests.training.lineage.test_lineage import ingest_users, run_once
from tests.training.test_services import plain_spec
from training.lineage.services import user_erase


def _get(user, url: str) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def test_the_data_page_shows_retention_consent_redactions_and_erasures(creds, bob, django_capture_on_commit_callbacks):
    data_policy_set(creds.project, retention_days=90, redactors=["email"], erasure_policy="keep")
    with django_capture_on_commit_callbacks(execute=True):
        feedback_ingest(creds.project, [trajectory("t-1", prompt="mail a@example.com", user="u-1"),
                                        trajectory("t-2", consent="no_train", user="u-2"), trajectory("t-3")])
    consent_opt_out_set(creds.project, "u-3", True)
    user_erase(creds.project, "u-1", "cli:erase_user")
    body = _get(bob, f"/p/{creds.project.slug}/data/")
    for marker in ("90 days", "<td>email</td><td>1</td>", "Erasures (1)", "cli:erase_user", "<td>keep</td>",
                   "Users who opted out</th><td>1", "Not to be trained on (no_train)</th><td>1 (0.500)"):
        assert marker in body, marker
    assert "u-1" not in body and "a@example.com" not in body


def test_the_replay_and_registry_pages_show_which_versions_learned_from_what(creds, bob, production, tokenizer):  # noqa: F811
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4})
    run = run_once(creds.project)
    t = Trajectory.objects.get(external_id="t-0")
    replay = _get(bob, f"/p/{creds.project.slug}/rollouts/{t.id}/")
    assert 'id="lineage"' in replay and f"v{run.candidate.number}" in replay and f"run {run.pk}" in replay
    registry = _get(bob, f"/p/{creds.project.slug}/registry/")
    assert f"?run={run.pk}\">#{run.pk}</a></td>\n    <td>v{run.candidate.number}</td><td>4</td><td>4</td>" in registry
    data_policy_set(creds.project, erasure_policy="flag")
    user_erase(creds.project, "u-a", "cli:erase_user")
    assert "1 version(s) learned from data since erased" in _get(bob, f"/p/{creds.project.slug}/registry/")
