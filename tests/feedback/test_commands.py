"""manage.py create_project / create_key / rotate_secret / revoke_key."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from feedback.models import ApiKey, Project, WebhookSecret

pytestmark = pytest.mark.django_db


def _call(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_project_prints_json_credentials_once_and_stores_only_a_hash():
    out = json.loads(_call("create_project", "My Product", "--json"))
    assert set(out) == {"project", "api_key", "webhook_secret"}
    assert out["webhook_secret"].startswith("whsec_") and out["api_key"].startswith("fw_")
    key = ApiKey.objects.get(project__slug=out["project"])
    assert out["api_key"] not in (key.key_hash, key.prefix) and key.matches(out["api_key"])


def test_rotate_then_revoke():
    slug = json.loads(_call("create_project", "P", "--json"))["project"]
    new = json.loads(_call("rotate_secret", slug, "--json"))["webhook_secret"]
    assert WebhookSecret.objects.filter(project__slug=slug, revoked_at__isnull=True).count() == 2
    assert [s.secret for s in WebhookSecret.objects.filter(project__slug=slug, expires_at__isnull=True)] == [new]
    raw = _call("create_key", slug, "--scopes", "read").strip()
    _call("revoke_key", raw[:11])
    assert ApiKey.objects.get(prefix=raw[:11]).revoked_at is not None
    assert Project.objects.filter(slug=slug).exists()
