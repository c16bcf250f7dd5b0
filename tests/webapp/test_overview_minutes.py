"""The overview shows the loop at its own time scale: minute buckets for the last two hours,
hourly before, and promotion marks at the moment of promotion."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from training.models import AuditLog, PolicyVersion
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
    client.force_login(get_user_model().objects.create_user("viewer", is_staff=True))
    body = client.get(f"/p/{creds.project.slug}/rollouts/").content.decode()
    assert "def add(a, b):" in body and "return a -" in body and "0.750" in body and "reject" in body
    only = client.get(f"/p/{creds.project.slug}/rollouts/?signal=reject").content.decode()
    assert ">bad<" in only and ">good<" not in only
    high = client.get(f"/p/{creds.project.slug}/rollouts/?reward_min=0.5").content.decode()
    assert ">good<" in high and ">bad<" not in high
    silent = client.get(f"/p/{creds.project.slug}/rollouts/?signal=none").content.decode()
    assert ">quiet<" in silent and ">good<" not in silent
