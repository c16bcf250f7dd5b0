"""Strict environment helpers, the embedded services, and the plain pages."""

from __future__ import annotations

import pytest

from core import embedded
from core.env import ConfigError, env_bool, env_int


def test_a_bad_boolean_is_an_error_not_false(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_FLAG", "maybe")
    with pytest.raises(ConfigError, match="FLYWHEEL_FLAG"):
        env_bool("FLYWHEEL_FLAG", False)
    monkeypatch.setenv("FLYWHEEL_FLAG", "off")
    assert env_bool("FLYWHEEL_FLAG", True) is False


def test_a_bad_integer_is_an_error(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_N", "12x")
    with pytest.raises(ConfigError, match="not an integer"):
        env_int("FLYWHEEL_N", 1)


def test_database_url_must_be_postgres():
    from webapp.settings import _database_from_url

    with pytest.raises(ConfigError, match="postgresql://"):
        _database_from_url("mysql://u@h/db")
    socket_db = _database_from_url("postgresql://postgres@/flywheel?host=/tmp/x")
    assert socket_db["HOST"] == "/tmp/x" and socket_db["NAME"] == "flywheel"
    tcp = _database_from_url("postgresql://u:p%40ss@db.internal:6543/fw")
    assert (tcp["HOST"], tcp["PORT"], tcp["PASSWORD"]) == ("db.internal", "6543", "p@ss")


def test_embedded_redis_is_reused_and_never_on_the_standard_port():
    first, second = embedded.redis_url(), embedded.start_redis()
    assert first == second and not first.endswith(":6379")


def test_embedded_postgres_listens_on_a_unix_socket_only():
    url = embedded.postgres_url()
    assert "host=/" in url and embedded.postgres_url() == url


@pytest.mark.django_db
def test_healthz_and_login_required(client):
    assert client.get("/healthz").json() == {"ok": True}
    response = client.get("/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


@pytest.mark.django_db
def test_a_logged_in_user_sees_the_projects(client, bob, creds):
    client.force_login(bob)
    response = client.get("/")
    assert response.status_code == 200 and b"acme" in response.content


ON = {"fsync": "on", "full_page_writes": "on", "synchronous_commit": "on"}


def test_the_embedded_postgres_is_durable_unless_the_suite_starts_it(own_postgres):
    # The test switch applies only to a server the suite itself starts...
    own_postgres.down()
    url = own_postgres.up(undurable=True)
    assert set(own_postgres.settings(url).values()) == {"off"}
    # ...and a durable caller (the demo, a bench, a worker: no switch) turns durability back on.
    assert own_postgres.durable_url() == url
    assert own_postgres.settings(url) == ON
    # The switch never turns it off on a running server, and a fresh start is durable.
    own_postgres.up(undurable=True)
    assert own_postgres.settings(url) == ON
    own_postgres.down()
    assert own_postgres.settings(own_postgres.up()) == ON


def test_the_demo_refuses_the_test_only_switch(monkeypatch):
    from webapp.demo import _environment

    monkeypatch.setenv("FLYWHEEL_TEST_PG_UNDURABLE", "1")
    with pytest.raises(ConfigError, match="test suite only"):
        _environment()


@pytest.mark.django_db(transaction=True)
def test_the_test_clients_host_is_not_served_by_default(asgi_server):
    import httpx

    from webapp import settings as project_settings

    assert "testserver" not in project_settings.ALLOWED_HOSTS
    assert httpx.get(asgi_server + "/healthz").status_code == 200
    assert httpx.get(asgi_server + "/healthz", headers={"Host": "testserver"}).status_code == 400
