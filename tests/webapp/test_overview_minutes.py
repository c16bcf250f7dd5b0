"""The overview shows the loop at its own time scale: minute buckets for the last two hours,
hourly before, and promotion marks at the moment of promotion."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from feedback.services import feedback_ingest
from tests.factories import feedback, member, trajectory
from training.models import AuditLog, GateReport, PolicyVersion
from webapp import selectors


def _at(minutes_ago: float) -> str:
    return (timezone.now() - timedelta(minutes=minutes_ago)).isoformat()


def test_recent_feedback_is_bucketed_per_minute_and_promotions_are_marked_when_they_happened(creds):
    events = []
    for i, (ago, version, signal) in enumerate([(9, 1, "reject"), (9, 1, "accept"), (4, 2, "accept"),
                                                (4, 2, "accept"), (3, 2, "reject")]):
        events += [trajectory(f"t{i}", policy_version=version, occurred_at=_at(ago)),
                   feedback(f"f{i}", f"t{i}", signal, occurred_at=_at(ago))]
    assert all(r.status == "accepted" for r in feedback_ingest(creds.project, events))
    v2 = PolicyVersion.objects.create(project=creds.project, number=2, state="production")
    row = AuditLog.objects.create(project=creds.project, actor="alice", action="approve",
                                  target=f"policy_version:{v2.id}", before={"state": "awaiting_approval"},
                                  after={"number": 2, "state": "production"})

    figures = selectors.overview_charts(creds.project, days=1)["figures"]
    rate = {t["name"]: t for t in figures["rate"]["data"]}
    assert rate["v1"]["y"] == [0.5] and len(rate["v2"]["x"]) == 2  # two minutes of v2
    assert rate["v2"]["y"] == [1.0, 0.0]
    marks = figures["rate"]["layout"]["annotations"]
    assert [m["text"] for m in marks] == ["v2 promoted"] and marks[0]["x"] == row.at.isoformat()


def test_the_rollouts_list_tells_prompt_completion_signals_and_reward_and_filters_by_them(creds, client):
    from django.contrib.auth import get_user_model

    from training.models import Reward, RewardSpec

    events = [trajectory("good", prompt=[{"role": "user", "content": "def add(a, b):"}]),
              feedback("f1", "good", "accept"),
              trajectory("bad", steps=[{"role": "assistant", "content": " return a -"}]),
              feedback("f2", "bad", "reject"), trajectory("quiet")]
    feedback_ingest(creds.project, events)
    spec = RewardSpec.objects.create(project=creds.project, version=1, signal_rewards={}, checks=[], aspects=[],
                                     judge={})
    for ext, total in (("good", 0.75), ("bad", -0.25)):
        Reward.objects.create(trajectory=creds.project.trajectories.get(external_id=ext), spec=spec, total=total,
                              components={})
    client.force_login(member(get_user_model().objects.create_user("viewer"), creds.project, "viewer"))
    body = client.get(f"/p/{creds.project.slug}/rollouts/").content.decode()
    assert "def add(a, b):" in body and "return a -" in body and "0.750" in body and "reject" in body
    only = client.get(f"/p/{creds.project.slug}/rollouts/?signal=reject").content.decode()
    assert ">bad<" in only and ">good<" not in only
    high = client.get(f"/p/{creds.project.slug}/rollouts/?reward_min=0.5").content.decode()
    assert ">good<" in high and ">bad<" not in high
    silent = client.get(f"/p/{creds.project.slug}/rollouts/?signal=none").content.decode()
    assert ">quiet<" in silent and ">good<" not in silent


def test_accept_rate_per_version_live_counts_silence_as_not_accepted_and_held_out_comes_from_the_gate(creds, client, bob):
    events = []
    for i, (version, signal) in enumerate([(1, "accept"), (1, "reject"), (1, None), (1, None), (2, "accept"),
                                           (2, "accept")]):
        events.append(trajectory(f"t{i}", policy_version=version, occurred_at=_at(5)))
        if signal:
            events.append(feedback(f"f{i}", f"t{i}", signal, occurred_at=_at(5)))
    assert all(r.status == "accepted" for r in feedback_ingest(creds.project, events))
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    v2 = PolicyVersion.objects.create(project=creds.project, number=2, parent=v1, state="awaiting_approval")
    v3 = PolicyVersion.objects.create(project=creds.project, number=3, parent=v1, state="rejected")
    GateReport.objects.create(version=v2, baseline=v1, passed=True,
                              policy={"suite": {"accept": {"candidate": 0.6, "production": 0.3}}})
    GateReport.objects.create(version=v3, baseline=v1, passed=False,
                              policy={"suite": {"accept": {"candidate": 0.2, "production": 0.31}}})

    rows = {r["number"]: r for r in selectors.accept_by_version(creds.project, days=1)}
    assert [rows[n]["live"] for n in (1, 2, 3)] == [0.25, 1.0, None]
    assert [rows[n]["served"] for n in (1, 2, 3)] == [4, 2, 0]
    assert [rows[n]["held_out"] for n in (1, 2, 3)] == [0.31, 0.6, 0.2]  # v1: its newest report as baseline

    client.force_login(bob)
    page = client.get(f"/p/{creds.project.slug}/").content.decode()
    assert 'id="accept-by-version"' in page and "0.250" in page and "0.310" in page
