"""core.db.CompiledQuery against the ORM it stands in for: the same instance, its select_related
object and its annotation, from SQL compiled once per thread (feedback.auth's signing look-up)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from core.db import CompiledQuery
from feedback.auth import _SIGNING_PROJECT, _signing_project_query
from feedback.models import DataPolicy, Project, WebhookSecret
from feedback.services import project_create, webhook_secret_rotate

pytestmark = pytest.mark.django_db


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_the_compiled_look_up_builds_what_the_orm_builds(creds):
    DataPolicy.objects.update_or_create(project=creds.project, defaults={"redactors": ["email"], "retention_days": 30})
    bare = project_create("no policy yet").project
    for project in (creds.project, bare):
        orm = _signing_project_query(project.slug).first()
        compiled = _SIGNING_PROJECT.get(slug=project.slug)
        assert _fields(compiled) == _fields(orm) and compiled._state.adding is False and compiled._state.db == "default"
        assert compiled.active_secrets_encrypted == orm.active_secrets_encrypted and len(orm.active_secrets_encrypted) == 1
        related = Project.data_policy.related
        assert related.is_cached(compiled)  # no query later for the policy
        policy, expected = related.get_cached_value(compiled), related.get_cached_value(orm)
        assert (policy and _fields(policy)) == (expected and _fields(expected))
    assert _SIGNING_PROJECT.get(slug="nobody-has-this") is None


def test_the_secrets_are_read_at_the_time_the_query_runs_not_when_it_was_compiled(creds):
    _SIGNING_PROJECT.get(slug=creds.project.slug)  # compiled on this thread
    new = webhook_secret_rotate(creds.project)
    assert len(_SIGNING_PROJECT.get(slug=creds.project.slug).active_secrets_encrypted) == 2  # rotation's grace
    WebhookSecret.objects.filter(project=creds.project).exclude(pk=new.pk).update(
        expires_at=timezone.now() - timedelta(milliseconds=1))
    assert _SIGNING_PROJECT.get(slug=creds.project.slug).active_secrets_encrypted == [new.secret_encrypted]


@pytest.mark.django_db(transaction=True)
def test_each_thread_compiles_and_runs_on_its_own_connection():
    slug = project_create("threads").project.slug
    got = []

    def look_up():
        got.append(_SIGNING_PROJECT.get(slug=slug).slug)

    threads = [threading.Thread(target=look_up) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [slug] * 3


def test_a_placeholder_the_query_does_not_use_is_refused():
    query = CompiledQuery(lambda slug: Project.objects.filter(name="fixed"), slug="\x00slug")
    with pytest.raises(ValueError, match="placeholders \\['slug'\\]"):
        query.get(slug="x")
