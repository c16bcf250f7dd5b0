"""A mid-training run whose Celery worker is killed (SIGKILL) mid-run fails cleanly, registers
nothing, and the project's next run proceeds.

    .venv/bin/python -m pytest tests/training/runs/test_midtrain_killed.py -q
"""

from __future__ import annotations

import pytest

from tests.processes import wait_until
from tests.training.runs.test_midtrain import CODE
from tests.training.runs.test_self_healing import doomed_worker, kill  # noqa: F401 - the fixture
from training.corpora.services import corpus_add_paths
from training.models import PolicyVersion, TrainingRun, TrainingStep
from training.runs.services import midtrain_start, train_policy

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_killed_midtrain_worker_fails_its_run_and_the_next_run_proceeds(creds, production, tmp_path,
                                                                           doomed_worker):  # noqa: F811
    from training.tasks import train_policy_task

    proc, queue = doomed_worker
    for i in range(12):  # blobs in the default store: the worker process reads them there too
        (tmp_path / f"ledger_{i}.py").write_text(CODE.replace("{i}", str(i)))
    corpus_add_paths(creds.project, [str(tmp_path)])
    doomed, _ = midtrain_start(creds.project, steps=1_000_000, batch_size=2, seq_len=32, enqueue=False)
    train_policy_task.apply_async(args=[doomed.pk], queue=queue)
    wait_until(lambda: TrainingStep.objects.filter(run=doomed).exists(), timeout=120, what="the first mid-training step")
    kill(proc)

    following, created = midtrain_start(creds.project, steps=3, batch_size=2, seq_len=32, enqueue=False)
    assert created
    doomed.refresh_from_db()
    assert doomed.state == "failed" and "worker lost" in doomed.error and "is gone" in doomed.error
    assert doomed.candidate is None
    following = train_policy(following.pk)
    assert following.state == "succeeded", following.error
    assert list(PolicyVersion.objects.filter(project=creds.project).values_list("number", flat=True)
                .order_by("number")) == [1, 2]
    assert TrainingRun.objects.filter(project=creds.project, state="running").count() == 0
