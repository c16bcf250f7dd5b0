"""Secrets: webhook secrets encrypted at rest and shown once, user ids HMAC-ed with a server-side
pepper, settings that refuse to start without secrets, `check --deploy` clean under production
settings, throttled password sign-ins, and the embedded PostgreSQL's password auth and socket.

    .venv/bin/python -m pytest tests/webapp/test_secrets.py -q
"""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
import subprocess
import sys

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from core import embedded
from feedback.models import FeedbackEvent, WebhookSecret
from feedback.services import feedback_ingest, user_hash_key
from tests.processes import ROOT, subprocess_env


@pytest.mark.django_db
def test_a_webhook_secret_is_stored_encrypted_and_still_verifies(creds, post_events):
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret_encrypted FROM feedback_webhooksecret WHERE project_id = %s", [creds.project.pk])
        (stored,) = cursor.fetchone()
    assert creds.webhook_secret not in stored and creds.webhook_secret[6:16] not in stored
    assert WebhookSecret.objects.get(project=creds.project).secret == creds.webhook_secret
    event = {"type": "feedback", "id": "fb-1", "trajectory_id": "t-1", "signal": "accept"}
    assert post_events([event]).status_code == 202


@pytest.mark.django_db
def test_a_secret_written_under_another_key_does_not_decrypt(creds):
    from cryptography.fernet import Fernet

    from core.secretbox import SecretUnreadable

    with override_settings(FLYWHEEL_SECRETS_KEY=Fernet.generate_key().decode()):
        with pytest.raises(SecretUnreadable, match="FLYWHEEL_SECRETS_KEY"):
            WebhookSecret.objects.get(project=creds.project).secret  # noqa: B018


@pytest.mark.django_db
def test_an_empty_webhook_secret_is_refused(creds):
    with pytest.raises(ValueError, match="whsec_"):
        WebhookSecret(project=creds.project).secret = ""
    with pytest.raises(IntegrityError), transaction.atomic():
        WebhookSecret.objects.create(project=creds.project, secret_encrypted="")


@pytest.mark.django_db
def test_the_admin_shows_neither_a_secret_nor_its_prefix_and_generates_new_ones(admin_client, creds):
    listing = admin_client.get("/admin/feedback/webhooksecret/").content.decode()
    row = WebhookSecret.objects.get(project=creds.project)
    change = admin_client.get(f"/admin/feedback/webhooksecret/{row.pk}/change/").content.decode()
    for page in (listing, change):
        assert creds.webhook_secret[:12] not in page and "whsec_" not in page
    # Shown once, on the page that answers the add: never in a message (messages live in a cookie).
    added = admin_client.post("/admin/feedback/webhooksecret/add/", {"project": creds.project.pk})
    assert added.status_code == 200 and not list(added.context["messages"])
    new = WebhookSecret.objects.filter(project=creds.project).order_by("-pk").first()
    assert new.pk != row.pk and new.secret.startswith("whsec_") and new.secret in added.content.decode()
    assert new.secret not in admin_client.get("/admin/feedback/webhooksecret/").content.decode()


@pytest.mark.django_db
def test_user_ids_are_hmac_ed_with_the_server_pepper_not_the_project_slug(creds, settings):
    event = {"type": "feedback", "id": "fb-1", "trajectory_id": "t-1", "signal": "accept", "user": "ada@example.com"}
    feedback_ingest(creds.project, [event])
    stored = FeedbackEvent.objects.get(event_id="fb-1").user_hash
    assert stored != hashlib.sha256(b"acme:ada@example.com").hexdigest()
    key = user_hash_key(creds.project)
    assert stored == hmac.new(key.encode(), b"ada@example.com", hashlib.sha256).hexdigest()
    settings.FLYWHEEL_USER_PEPPER = "another-server"
    assert user_hash_key(creds.project) != key  # without the pepper the hashes cannot be recomputed
    feedback_ingest(creds.project, [{**event, "id": "fb-2"}])  # under the new key, not a remembered one
    again = FeedbackEvent.objects.get(event_id="fb-2").user_hash
    assert again == hmac.new(user_hash_key(creds.project).encode(), b"ada@example.com", hashlib.sha256).hexdigest()
    assert again != stored


def _settings_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.django_db
def test_settings_refuse_to_start_without_secrets_when_debug_is_off():
    env = subprocess_env(DEBUG="0")
    for name in ("SECRET_KEY", "FLYWHEEL_SECRETS_KEY", "FLYWHEEL_USER_PEPPER"):
        env.pop(name)
    result = _settings_process(env, "check")
    assert result.returncode != 0
    assert "SECRET_KEY, FLYWHEEL_SECRETS_KEY, FLYWHEEL_USER_PEPPER must be set when DEBUG is off" in result.stderr


@pytest.mark.django_db
def test_check_deploy_is_clean_under_production_settings():
    from cryptography.fernet import Fernet

    env = subprocess_env(DEBUG="0", FLYWHEEL_HTTPS="1", ALLOWED_HOSTS="flywheel.example.com",
                         SECRET_KEY="k" + Fernet.generate_key().decode() + Fernet.generate_key().decode(),
                         FLYWHEEL_SECRETS_KEY=Fernet.generate_key().decode(), FLYWHEEL_USER_PEPPER="p" * 40)
    result = _settings_process(env, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr


def _fresh_net() -> str:
    """Addresses no earlier test session counted failures for (the counts live in Redis)."""
    import random

    return f"10.{random.randrange(256)}.{random.randrange(256)}"


@pytest.mark.django_db
def test_sign_ins_are_throttled_per_account_and_address_and_per_address(client, alice, bob, settings):
    settings.LOGIN_FAILURES_MAX = 3
    net = _fresh_net()

    def sign_in(username, password, address=f"{net}.1", path="/accounts/login/"):
        return client.post(path, {"username": username, "password": password}, REMOTE_ADDR=address)

    for _ in range(3):
        assert sign_in("alice", "wrong").status_code == 200
    locked = sign_in("alice", "alice-password-1")
    assert locked.status_code == 200 and b"Too many failed sign-ins" in locked.content
    admin_locked = sign_in("alice", "alice-password-1", path="/admin/login/")
    assert b"Too many failed sign-ins" in admin_locked.content
    # The address is locked for every account: trying one password on many accounts stops too.
    assert b"Too many failed sign-ins" in sign_in("bob", "bob-password-1").content
    assert sign_in("bob", "bob-password-1", address=f"{net}.3").status_code == 302


@pytest.mark.django_db
def test_a_stranger_cannot_lock_an_account_out_for_its_owner(client, alice, settings):
    settings.LOGIN_FAILURES_MAX = 3
    net = _fresh_net()
    for address in (f"{net}.1", f"{net}.2", f"{net}.3"):  # the attacker, from several addresses
        for _ in range(5):
            client.post("/accounts/login/", {"username": "alice", "password": "guess"}, REMOTE_ADDR=address)
    owner = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-1"},
                        REMOTE_ADDR=f"{net}.9")
    assert owner.status_code == 302  # signed in


def test_embedded_postgres_wants_a_password_on_a_private_socket():
    url = embedded.postgres_url()
    sock = embedded._socket_dir()
    assert stat.S_IMODE(sock.stat().st_mode) == 0o700
    assert (embedded.PG_DATA / "pg_hba.conf").read_text().split() == ["local", "all", "all", "scram-sha-256"]
    assert stat.S_IMODE(embedded.PG_PASSWORDS.stat().st_mode) == 0o600
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host=str(sock), user="postgres", dbname="postgres", password="").close()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    with psycopg.connect(embedded.postgres_app_url()) as conn:
        row = conn.execute("SELECT rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = current_user")
        assert row.fetchone() == (False, False, False)
    assert json.loads(embedded.PG_PASSWORDS.read_text())["postgres"] in url
