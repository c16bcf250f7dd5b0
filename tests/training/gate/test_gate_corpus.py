"""The gate's corpus rows: every version scored on the held-out files of the project's corpus; a
mid-trained candidate must lower the held-out loss and must not regress the users' reward.

    .venv/bin/python -m pytest tests/training/gate/test_gate_corpus.py -q
"""

from __future__ import annotations

import pytest

from tests.training.runs.test_midtrain import code_base  # noqa: F401 - the fixture
from training.corpora.lines import continuation_prompts
from training.corpora.services import corpus_add_paths
from training.gate.services import gate_run
from training.models import EvalSuite, PolicyVersion
from training.runs.services import midtrain_start, train_policy

pytestmark = pytest.mark.django_db


@pytest.fixture
def suite(creds):
    prompts = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(["def add(a, b):", "import os", "class Node:",
                                                                 "return self.", "with open(", "if not value:"])]
    return EvalSuite.objects.create(project=creds.project, version=1, prompts=prompts, n_samples=2, max_tokens=8)


@pytest.fixture
def midtrained(creds, production, code_base, suite):  # noqa: F811 - the fixture
    corpus_add_paths(creds.project, [str(code_base)])
    run, _ = midtrain_start(creds.project, steps=40, batch_size=4, seq_len=64, lr=3e-3, enqueue=False)
    return train_policy(run.pk).candidate


def test_continuation_prompts_cut_real_lines_and_keep_the_rest():
    texts = [("a.py", "def settle_quanta(self, rate):\n    return sum(q * rate for q in self.quanta)\nx\n")]
    prompts = continuation_prompts(texts, n=10, seed=3)
    assert len(prompts) == 2  # the one-character line is no prompt
    for p in prompts:
        line = p.prompt + p.rest
        assert line in texts[0][1] and 4 <= len(p.prompt) <= len(line) // 2


def _rows(report) -> dict[str, dict]:
    return {r["name"]: r for r in report.checks}


def test_a_mid_trained_candidate_is_scored_on_the_held_out_files(creds, midtrained):
    report = gate_run(midtrained.id)
    rows = _rows(report)
    assert rows["corpus_loss"]["value"] < 0 and rows["corpus_loss"]["passed"], rows["corpus_loss"]
    assert "must lower it" in rows["corpus_loss"]["detail"]
    continuation = rows["corpus_continuation"]
    assert continuation["threshold"] == -0.5 and continuation["interval"] is not None
    info = report.policy["suite"]["corpus"]
    assert info["candidate"]["loss"] < info["production"]["loss"] and info["prompts"] > 0
    assert rows["reward_improvement"]["threshold"] == -0.05 and "may not regress" in rows["reward_improvement"]["detail"]
    assert rows["kl"]["passed"] and "informational for a mid-trained candidate" in rows["kl"]["detail"]


def test_a_mid_trained_candidate_that_does_not_lower_the_held_out_loss_is_refused(creds, midtrained, tiny_policy_dir):
    # Planted: production already holds the mid-trained weights, the "mid-trained" candidate the base's.
    production = PolicyVersion.objects.get(project=creds.project, state="production")
    PolicyVersion.objects.filter(pk=production.pk).update(manifest_hash=midtrained.manifest_hash)
    planted = PolicyVersion.objects.create(project=creds.project, number=3, parent=production, state="candidate",
                                           checkpoint_path=str(tiny_policy_dir), config={"kind": "midtrain"})
    report = gate_run(planted.id)
    rows = _rows(report)
    assert rows["corpus_loss"]["value"] > 0 and not rows["corpus_loss"]["passed"]
    assert not report.passed
    planted.refresh_from_db()
    assert planted.state == "rejected"


def test_an_rl_candidate_gets_the_corpus_rows_as_information_unless_a_tolerance_is_set(creds, midtrained, alice):

    PolicyVersion.objects.filter(pk=midtrained.pk).update(config={"kind": "rl"})
    rows = _rows(gate_run(midtrained.id))
    assert rows["corpus_loss"]["passed"] and "informational" in rows["corpus_loss"]["detail"]
    assert rows["reward_improvement"]["threshold"] == 0.0  # an RL candidate must improve it


def test_onboarding_a_project_without_a_suite_gates_its_mid_trained_candidate_from_the_command(
        creds, production, code_base):  # noqa: F811 - the fixture
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("corpus", "add", "--project", creds.project.slug, str(code_base), stdout=out)
    call_command("corpus", "suite", "--project", creds.project.slug, "--prompts", "8", stdout=out)
    suite = EvalSuite.objects.get(project=creds.project)
    assert len(suite.prompts) == 8 and all(p["id"].startswith("corpus-") for p in suite.prompts)
    # scored by what a user would have kept of the real line, which each prompt carries
    assert suite.checks == [{"name": "intent_match", "weight": 1.0}]
    assert all(p["context"]["rest"] and p["context"]["prefix"] == p["prompt"] for p in suite.prompts)
    call_command("midtrain", "--project", creds.project.slug, "--steps", "30", "--seq-len", "64", "--lr", "3e-3",
                 "--gate", stdout=out)
    text = out.getvalue()
    assert "corpus_loss" in text and "corpus_continuation" in text and "matched_chars" in text and "v2: " in text
    assert PolicyVersion.objects.get(number=2).state in ("awaiting_approval", "rejected")


def test_a_mid_trained_candidate_is_not_held_to_the_old_bases_length_or_its_judge_but_to_its_detectors():
    # Measured: 5 minutes on a code base the base never saw made suggestions 2.2x the base's length
    # and its judge Δ +0.095 against the checks' -0.025; its held-out loss fell from 5.27 to 1.16.
    from training.gate.config import GateThresholds
    from training.gate.corpus_rows import midtrain_adjusted
    from training.gate.samples import CheckRow

    rows = [CheckRow("length_drift", 2.23, [0.5, 2.0], None, False, "mean completion length"),
            CheckRow("judge_verifiable_divergence", 0.12, 0.1, None, False, "judge Δ +0.095 vs verifiable Δ -0.025"),
            CheckRow("median_chars", 3.0, 6.0, None, False, "median characters"),
            CheckRow("invented_names", 0.2, 0.0, [0.1, 0.3], False, "share of invented names"),
            CheckRow("collapse_top_share", 0.5, 0.11, None, False, "the most common suggestion's share")]
    out = {r.name: r for r in midtrain_adjusted(rows, GateThresholds())}
    assert out["length_drift"].passed and "informational for a mid-trained candidate" in out["length_drift"].detail
    assert out["judge_verifiable_divergence"].passed
    assert not any(out[n].passed for n in ("median_chars", "invented_names", "collapse_top_share"))
