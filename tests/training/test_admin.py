"""The admin keeps a used reward spec immutable: an edit there becomes a new version."""

from __future__ import annotations

import json

import pytest

from feedback.services import feedback_ingest
from tests.factories import trajectory
from training.models import Reward, RewardSpec
from training.rewards.services import reward_spec_default

pytestmark = pytest.mark.django_db


def _change(client, spec: RewardSpec, settle: int):
    return client.post(f"/admin/training/rewardspec/{spec.pk}/change/", {
        "project": spec.project_id, "signal_rewards": json.dumps(spec.signal_rewards),
        "checks": json.dumps(spec.checks), "aspects": json.dumps(spec.aspects), "judge": json.dumps(spec.judge),
        "settle_seconds": settle,
    })


def test_editing_a_used_spec_in_the_admin_makes_a_new_version(client, creds, django_user_model):
    admin = django_user_model.objects.create_superuser("root", "root@localhost", "root-password-1")
    client.force_login(admin)
    spec = reward_spec_default(creds.project)
    assert _change(client, spec, 30).status_code == 302
    spec.refresh_from_db()
    assert spec.settle_seconds == 30 and RewardSpec.objects.count() == 1  # unused: edited in place
    feedback_ingest(creds.project, [trajectory("t-1")])
    Reward.objects.create(trajectory_id=creds.project.trajectories.get().pk, spec=spec, total=0.5)
    assert _change(client, spec, 5).status_code == 302
    spec.refresh_from_db()
    assert spec.settle_seconds == 30
    assert RewardSpec.objects.get(version=2).settle_seconds == 5
