"""`make demo` onboards its users' code base once, as the README tells a new project to: the code
base registered as a corpus, the base mid-trained on it, the candidate gated (webapp/demo
`demo_onboard`, which bench/learning_curve.py --midtrain-minutes runs too).

    .venv/bin/python -m pytest tests/webapp/test_demo_onboarding.py -q
"""

from __future__ import annotations

import json

import pytest
from django_celery_beat.models import PeriodicTask

from tests.training.conftest import checkpoint_root, ckpt_settings, production, tiny_policy_dir  # noqa: F401
from tests.training.runs.test_midtrain import code_base  # noqa: F401 - the fixture
from training.models import Corpus, EvalSuite, GateReport, PolicyVersion, TrainingRun
from webapp import demo

pytestmark = pytest.mark.django_db


def test_the_code_base_becomes_a_corpus_and_a_gated_mid_trained_candidate(creds, production, code_base):  # noqa: F811
    out = demo.demo_onboard(creds.project, code_base, steps=20, batch_size=4, seq_len=64, lr=3e-3)
    corpus = Corpus.objects.get(project=creds.project)
    assert corpus.files_count == 24 and out["corpus_files"] == 24
    candidate = PolicyVersion.objects.get(project=creds.project, number=out["version"])
    assert out["version"] == 2 and candidate.parent_id == production.id
    assert candidate.state in ("awaiting_approval", "rejected")  # gated, a person decides the rest
    report = GateReport.objects.get(version=candidate)
    assert out["gate_passed"] == report.passed and {"corpus_loss", "corpus_continuation"} <= {
        c["name"] for c in report.checks}
    assert out["steps"] == 20 and out["loss_last"] < out["loss_first"]
    suite = EvalSuite.objects.get(project=creds.project)  # it had none: the held-out lines make one
    assert suite.checks == [{"name": "intent_match", "weight": 1.0}]
    # from now on the beat's runs replay the code base beside the users' prompts
    entry = PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}")
    assert json.loads(entry.kwargs)["replay"]["share"] == demo.DEMO_REPLAY_SHARE


def test_the_demo_schedule_replays_only_a_corpus_the_project_has(creds):
    demo._demo_schedule(creds.project)  # no corpus yet: a replay run would have nothing to cut from
    entry = PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}")
    assert json.loads(entry.kwargs).get("replay") is None


def test_onboarding_happens_once_and_only_for_the_users_who_type_their_own_code(creds, production, code_base,  # noqa: F811
                                                                             monkeypatch):
    monkeypatch.setenv("FLYWHEEL_DEMO_CORPUS", str(code_base))
    monkeypatch.setenv("FLYWHEEL_DEMO_TASTE", "compiles")  # the stdlib the base was pretrained on
    demo._demo_onboard_once(creds.project.slug)
    assert not Corpus.objects.filter(project=creds.project).exists()
    monkeypatch.setenv("FLYWHEEL_DEMO_TASTE", "intent")
    monkeypatch.setenv("FLYWHEEL_DEMO_MIDTRAIN_MINUTES", "0")  # switched off
    demo._demo_onboard_once(creds.project.slug)
    assert not Corpus.objects.filter(project=creds.project).exists()
    monkeypatch.setenv("FLYWHEEL_DEMO_MIDTRAIN_MINUTES", "0.02")
    demo._demo_onboard_once(creds.project.slug)
    assert Corpus.objects.filter(project=creds.project).count() == 1
    assert TrainingRun.objects.filter(project=creds.project).count() == 1
    demo._demo_onboard_once(creds.project.slug)  # a restarted demo: the corpus is there
    assert TrainingRun.objects.filter(project=creds.project).count() == 1
