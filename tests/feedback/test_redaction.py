"""Redaction at ingest: the built-in redactors, a project's own patterns (validated, bounded),
overlapping matches, and work that stays linear on hostile inputs (counted, not timed).

    .venv/bin/python -m pytest tests/feedback/test_redaction.py -q
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import BadRequest
from feedback.models import DEFAULT_REDACTORS, DataPolicy, RedactionTally, Step, Trajectory
from feedback.services import data_policy_of, feedback_ingest
from feedback.userdata.redaction import BUILTIN, Redactor, atoms_of, redactor_for, reference_scan
from feedback.userdata.services import data_policy_set
from tests.factories import trajectory

EVERY = ["email", "api_key", "ipv4", "ipv6"]
KEY = "sk-" + "A1b2C3d4E5f6G7h8J9k0L1m2"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJlLXBhcnQ"


def redact(text: str, names=EVERY, custom=()) -> tuple[str, dict[str, int]]:
    counts: dict[str, int] = {}
    return redactor_for(names, custom).redact(text, counts), counts


def test_emails_keys_tokens_and_ip_addresses_are_replaced_and_counted_per_redactor():
    text = (f"mail ann.lee+x@mail.example.org, key {KEY}, aws AKIAIOSFODNN7EXAMPLE, jwt {JWT}, "
            "from 192.168.10.7 and 2001:db8::8a2e:370:7334; version 1.2.3 and 10.0.0.999 stay")
    out, counts = redact(text)
    assert out == ("mail [redacted:email], key [redacted:api_key], aws [redacted:api_key], jwt [redacted:api_key], "
                   "from [redacted:ipv4] and [redacted:ipv6]; version 1.2.3 and 10.0.0.999 stay")
    assert counts == {"email": 1, "api_key": 3, "ipv4": 1, "ipv6": 1}


def test_code_that_looks_like_an_address_stays_and_addresses_in_it_do_not():
    code = ('pairs = zip(args[::2], args[1::2]); rev = s[-1::-1]; q = f"({sql})::date"; x = y[::da]\n'
            'HOST = "127.0.0.1"; BIND = "0.0.0.0"; LOCAL = "[::1]"; version = "1.2"; ratio = 0.5')
    assert redact(code) == (code, {})  # loopback and "any" name nobody; slices and casts are no address
    out, counts = redact('peer = "fe80::1ff:fe23:4567:890a"; gw = "fe80::1"; v4 = "::ffff:10.0.0.7"')
    assert out == 'peer = "[redacted:ipv6]"; gw = "[redacted:ipv6]"; v4 = "[redacted:ipv4+ipv6]"'
    assert counts == {"ipv6": 3, "ipv4": 1}  # the mapped IPv4 address inside is one too


def test_overlapping_matches_become_one_replacement_counted_for_each_redactor():
    out, counts = redact(f"x {KEY}@corp.example.com y")  # a key that is also an address's local part
    assert out == "x [redacted:api_key+email] y" and counts == {"api_key": 1, "email": 1}
    out, counts = redact("a@b.example.com@c.example.com", ["email"])  # chained: the first address, the rest no address
    assert out == "[redacted:email]@c.example.com" and counts == {"email": 1}


def test_a_custom_pattern_is_a_bounded_sequence_or_refused_with_the_fix():
    out, counts = redact("ticket ACME-00012345 closed", [], [{"name": "ticket", "pattern": "ACME-[0-9]{6,10}"}])
    assert out == "ticket [redacted:ticket] closed" and counts == {"ticket": 1}
    assert atoms_of("a|b") == atoms_of("[ab]")  # one character either way: a class
    for bad in ["(a+)+b", "ab|cd", "[a-z]+x", "(ab){2}", r"(a)\1", "(?=a)b", "^abc", "a{0,5000}", "", "x" * 201, "(",
                "a{0,3}b"]:
        with pytest.raises(BadRequest) as refused:
            atoms_of(bad)
        assert refused.value.fix, bad
    with pytest.raises(BadRequest, match="not valid"):
        redactor_for([], [{"name": "Ticket!", "pattern": "x"}])
    with pytest.raises(BadRequest, match="unknown redactors"):
        redactor_for(["phone"])


HOSTILE = ["a", "a@", "@a.", "a.", "eyJ", "eyJaaaaaaaaa.", "1.", "1.1", ":", "f:", "sk-", "sk-aaaaaaaaaaaaaaaaa@",
           "AKIA", "ACME-1", "A"]


@pytest.mark.parametrize("name", [*BUILTIN, "custom"])
def test_the_work_on_hostile_inputs_grows_linearly_and_matches_the_compiled_pattern(name):
    patterns = BUILTIN[name] if name != "custom" else redactor_for([], [{"name": "c", "pattern": "ACME-[0-9]{6,10}"}]).patterns
    for pattern in patterns:
        for unit in HOSTILE:
            small, large = unit * 2000, unit * 4000
            spans, work = reference_scan(pattern.atoms, small, pattern.boundary)
            _, work_2x = reference_scan(pattern.atoms, large, pattern.boundary)
            assert work_2x <= 2 * work + 64, (name, unit, work, work_2x)  # linear: twice the input, twice the work
            assert work <= 4 * len(small) * len(pattern.atoms), (name, unit, work)
            assert spans == [m.span() for m in pattern.compiled.finditer(small)], (name, unit)


def test_a_megabyte_of_hostile_text_is_redacted_in_one_pass():
    text = ("a@" * 100_000) + " " + ("1." * 100_000) + " " + ("eyJ" * 100_000) + " " + (KEY + " ") * 5_000  # ~1.1 MB
    out, counts = redact(text)
    assert counts["api_key"] == 5_000 and KEY not in out


def test_ingest_stores_redacted_text_without_the_token_ids_that_encode_it_and_tallies(
        creds, client, settings, django_capture_on_commit_callbacks):
    data_policy_set(creds.project, redactors=["email", "api_key"])
    event = trajectory("t-1", prompt=[{"role": "user", "content": "reply to bob@example.com"}],
                       prompt_token_ids=[1, 2, 3],
                       steps=[{"role": "assistant", "content": f"use {KEY}", "token_ids": [5, 6],
                               "logprobs": [-0.1, -0.2]},
                              {"role": "assistant", "content": "fine", "token_ids": [7], "logprobs": [-0.3]}],
                       note="cc alice@example.com")
    with django_capture_on_commit_callbacks(execute=True):  # the tally is written after the commit
        assert [r.status for r in feedback_ingest(creds.project, [event])] == ["accepted"]
    stored = Trajectory.objects.get(external_id="t-1")
    assert stored.prompt == [{"role": "user", "content": "reply to [redacted:email]"}]
    assert stored.extra["note"] == "cc [redacted:email]" and "prompt_token_ids" not in str(stored.extra)
    first, second = Step.objects.filter(trajectory=stored).order_by("index")
    assert (first.content, first.token_ids, first.logprobs) == ("use [redacted:api_key]", None, None)
    assert (second.content, second.token_ids) == ("fine", [7])  # untouched text keeps its sample
    assert dict(RedactionTally.objects.values_list("redactor", "count")) == {"email": 2, "api_key": 1}
    settings.FLYWHEEL_METRICS_TOKEN = "scrape-me"
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()
    assert f'flywheel_redactions_total{{project="{creds.project.slug}",redactor="email"}} 2.0' in text


def test_a_new_project_redacts_every_built_in_kind_by_default(creds):
    assert not DataPolicy.objects.exists()  # no policy row: the defaults
    feedback_ingest(creds.project, [trajectory("t-1", prompt=f"mail bob@example.com, key {KEY}, from 10.1.2.3")])
    assert Trajectory.objects.get().prompt[0]["content"] == (
        "mail [redacted:email], key [redacted:api_key], from [redacted:ipv4]")
    assert sorted(DEFAULT_REDACTORS) == sorted(BUILTIN)


def test_a_project_that_turned_redaction_off_stores_text_as_sent(creds):
    data_policy_set(creds.project, redactors=[])
    feedback_ingest(creds.project, [trajectory("t-1", prompt="mail bob@example.com")])
    assert Trajectory.objects.get().prompt[0]["content"] == "mail bob@example.com"
    assert not RedactionTally.objects.exists()


def test_the_policy_read_with_the_project_is_the_one_stored_and_costs_no_query(creds, django_assert_num_queries):
    from feedback.models import Project

    fetched = Project.objects.select_related("data_policy").get(pk=creds.project.pk)
    with django_assert_num_queries(0):  # no row: the defaults, known from the join
        assert data_policy_of(fetched).pk is None and sorted(data_policy_of(fetched).redactors) == sorted(BUILTIN)
    data_policy_set(creds.project, redactors=["email"])
    fetched = Project.objects.select_related("data_policy").get(pk=creds.project.pk)
    with django_assert_num_queries(0):
        assert data_policy_of(fetched).redactors == ["email"]
    plain = Project.objects.get(pk=creds.project.pk)
    with django_assert_num_queries(1):  # fetched without it: read now
        assert data_policy_of(plain).redactors == ["email"]


def test_projects_that_existed_before_the_default_keep_redaction_off_and_their_own_policy(creds):
    from django.apps import apps

    from feedback.services import project_create

    migration = importlib.import_module("feedback.migrations.0006_redaction_on_by_default")
    own = project_create("Own policy", "own").project
    data_policy_set(own, redactors=["email"], retention_days=30)
    migration.keep_existing_projects_setting(apps, None)
    assert DataPolicy.objects.get(project=creds.project).redactors == []  # had none: the old default, kept
    assert (DataPolicy.objects.get(project=own).redactors, DataPolicy.objects.get(project=own).retention_days) == (
        ["email"], 30)
    later = project_create("Later", "later").project
    assert data_policy_of(later).redactors == list(DEFAULT_REDACTORS)


_PIECES = st.sampled_from(["1.2", "10.0.0.1", "255.255.255.255", "0.5", "::1", "fe80::1%", "2001:db8::7", "a@b.co",
                           "x.y@mail.example.org", KEY, "AKIAIOSFODNN7EXAMPLE", JWT, "v1.2.3", " ", "-", "_", ".", ":",
                           "sk_", "eyJ", "192.168.1", ".1.2.3.4.", "1.2.3.4"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_PIECES, st.text(max_size=6)), max_size=12))
def test_the_one_search_that_lets_most_text_through_never_skips_a_text_some_pattern_matches(parts):
    text = "".join(parts)
    gated = redactor_for(EVERY)
    # The reference: every pattern scanned on every text, no prefilter and no gate.
    plain = Redactor(tuple(dataclasses.replace(p, prefilter=None, needles=()) for p in gated.patterns))
    object.__setattr__(plain, "gate", None)
    assert gated.gate is not None
    assert gated.redact(text, {}) == plain.redact(text, {})
