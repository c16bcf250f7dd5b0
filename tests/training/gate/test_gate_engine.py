"""The gate end to end on real tiny torch policies: sampling through TorchEngine, scoring with a
verifiable check and the rule judge, the report row, and the version's new state.

"Better by construction": the candidate is the production model with the last attention layer's
value bias turned into a constant direction of the residual stream and the lm_head row of the
token "x" aligned with it, so it emits "x" most of the time; the suite's check rewards "x".
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from django.utils import timezone

from core.errors import NotFound
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from training.gate.services import gate_run
from training.gate.tasks import gate_run_task
from training.models import AuditLog, EvalSuite, PolicyVersion
from training.pretrain import PolicyConfig, build_policy, load_tokenizer, stdlib_corpus
from training.promotion.services import gate_policy_update
from training.rewards.checks import Check, CheckResult, register_check
from training.rewards.services import reward_spec_update, rewards_compute_pending


@register_check("x_rate")
class XRate(Check):
    """Fraction of the completion's characters that are 'x' (the suite's verifiable check)."""

    def run(self, completion, context=None) -> CheckResult:
        return CheckResult(completion.count("x") / len(completion) if completion else 0.0, "share of 'x'")


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gate-policies")
    cfg = PolicyConfig(vocab_size=512, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                       tokenizer_lines=3000)
    plain = build_policy(root / "plain", cfg, stdlib_corpus(max_lines=3000))
    return {"plain": plain, "x": _x_lover(plain, root / "x")}


def _x_lover(source: Path, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, folder)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    x_id = load_tokenizer(source).encode("x", add_special_tokens=False)[0]
    with torch.no_grad():
        model.model.layers[-1].self_attn.v_proj.bias.fill_(50.0)  # residual ≈ constant direction
        hidden = model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states[-1][0]
        direction = hidden.mean(0)  # (H,)
        model.lm_head.weight[x_id] = 8.0 * direction / direction.norm() ** 2  # logit of "x" ≈ 8
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def suite(creds):
    prompts = [{"id": f"p{i}", "prompt": p} for i, p in
               enumerate(["def add(a, b):", "import os", "class Node:", "for i in range(", "return self.", "x = [",
                          "with open(", "if not value:"])]
    return EvalSuite.objects.create(project=creds.project, version=1, prompts=prompts,
                                    checks=[{"name": "x_rate", "weight": 1.0}],
                                    judge={"kind": "rule_rubric", "aspects": ["style", "concision"]},
                                    aspects=[{"name": "style", "weight": 0.1}, {"name": "concision", "weight": 0.1}],
                                    n_samples=3, max_tokens=12)


def _versions(project, production: Path, candidate: Path) -> tuple[PolicyVersion, PolicyVersion]:
    prod = PolicyVersion.objects.create(project=project, number=1, state="production", checkpoint_path=str(production))
    cand = PolicyVersion.objects.create(project=project, number=2, parent=prod, state="candidate",
                                        checkpoint_path=str(candidate))
    return prod, cand


@pytest.mark.django_db
def test_a_better_candidate_passes_the_gate_and_awaits_approval(creds, suite, policies, alice):
    # The x-lover writes shorter suggestions than the untrained base's tenth percentile (the
    # derived median floor): opened here, the candidate is better by the suite's check alone.
    gate_policy_update(creds.project, alice, "tiny models drift far", thresholds={
        "margin": 0.2, "kl_budget": 50.0, "aspect_tolerance": 0.5, "length_ratio_max": 2.0,
        "repeated_ngram_jump_max": 1.0, "min_median_chars": None})
    _, cand = _versions(creds.project, policies["plain"], policies["x"])
    report = gate_run(cand.id, actor="alice")
    rows = {r["name"]: r for r in report.checks}
    assert report.passed, [(r["name"], r["value"], r["threshold"], r["detail"]) for r in report.checks if not r["passed"]]
    assert rows["reward_improvement"]["interval"][0] > 0.2
    assert rows["kl"]["value"] > 0.5  # a real distance: the default budget would have stopped it
    assert report.policy["suite"] == {"name": "default", "version": 1, "prompts": 8, "accept": None}
    cand.refresh_from_db()
    assert cand.state == "awaiting_approval"
    actions = list(AuditLog.objects.filter(target=f"policy_version:{cand.id}").values_list("action", flat=True))
    assert actions == ["gate_start", "gate_pass"]


def _users_who_like_x(project, tokenizer, n: int = 80) -> None:
    """Live suggestions the users clicked: they accept the ones made mostly of "x", reject the rest."""
    reward_spec_update(project, judge={}, aspects=[], checks=[], settle_seconds=0)
    liked, disliked = ["xxxx", "x xx", "xxx x", "xx"], ["def f", "import os", "(a, b)", " = 1"]
    events = []
    for i in range(n):
        text = (liked if i % 2 else disliked)[(i // 2) % 4]
        step = {"role": "assistant", "content": text, "token_ids": tokenizer.encode(text, add_special_tokens=False)}
        events.append(trajectory(f"t-{i}", prompt=[{"role": "user", "content": "x = "}], steps=[step]))
        events.append(feedback(f"fb-{i}", f"t-{i}", signal="accept" if i % 2 else "reject"))
    feedback_ingest(project, events)
    rewards_compute_pending(project, now=timezone.now() + timedelta(seconds=1))


@pytest.mark.django_db
def test_the_report_tells_the_held_out_accept_rate_the_users_reward_model_predicts(creds, suite, policies):
    gate_policy_update(creds.project, "system:test", "tiny models drift far", thresholds={"kl_budget": 50.0})
    report = gate_run(_versions(creds.project, policies["plain"], policies["x"])[1].id)
    assert report.policy["suite"]["accept"] is None  # no clicks yet: nothing to fit

    _users_who_like_x(creds.project, load_tokenizer(policies["plain"]))
    cand = PolicyVersion.objects.create(project=creds.project, number=3, parent_id=report.version_id,
                                        state="candidate", checkpoint_path=str(policies["x"]))
    accept = gate_run(cand.id).policy["suite"]["accept"]
    assert accept["samples"] == 8 * 3 and accept["reward_model"]["labels"] == 80
    assert accept["candidate"] > accept["production"] + 0.3, accept


@pytest.mark.django_db
def test_a_worse_candidate_is_rejected_with_the_report(creds, suite, policies):
    _, cand = _versions(creds.project, policies["x"], policies["plain"])
    report = gate_run(cand.id)
    failed = {r["name"] for r in report.checks if not r["passed"]}
    assert not report.passed
    assert {"reward_improvement", "kl"} <= failed
    cand.refresh_from_db()
    assert cand.state == "rejected"
    assert AuditLog.objects.filter(action="gate_fail", reason__contains="reward_improvement").exists()


@pytest.mark.django_db
def test_a_gate_that_crashes_puts_the_candidate_back(creds, suite, tmp_path):
    _, cand = _versions(creds.project, tmp_path / "missing", tmp_path / "missing")
    with pytest.raises(NotFound, match="no checkpoint"):
        gate_run(cand.id)
    cand.refresh_from_db()
    assert cand.state == "candidate"
    assert AuditLog.objects.filter(action="gate_error").count() == 1


@pytest.mark.django_db
def test_the_gate_task_gates_the_first_version_without_a_baseline(creds):
    first = PolicyVersion.objects.create(project=creds.project, number=1, state="candidate")
    result = gate_run_task.apply(args=[first.id]).get()
    first.refresh_from_db()
    assert result["passed"] and first.state == "awaiting_approval"
    assert gate_run_task.name == "training.tasks.gate_run"


@pytest.mark.django_db
def test_with_agent_tasks_the_report_compares_the_tests_pass_share_on_the_same_seeds(creds, suite, policies):
    from training.rewards.agents import SAMPLE_TASKS
    from training.rewards.services import agent_task_add

    for task in SAMPLE_TASKS:
        agent_task_add(creds.project, task.name, dict(task.files), instruction=task.instruction)
    gate_policy_update(creds.project, "system:test", "tiny models drift far", thresholds={"kl_budget": 50.0})
    prod, cand = _versions(creds.project, policies["plain"], policies["plain"])  # the same weights
    report = gate_run(cand.id)
    row = next(r for r in report.checks if r["name"] == "agent_tests")
    agent = report.policy["suite"]["agent"]
    assert agent["tasks"] == 2 and agent["G"] == 2
    # same weights, same seeds (common random numbers): the very same rollouts, a difference of exactly 0
    assert agent["candidate"] == agent["production"] and row["value"] == 0.0 and row["interval"] == [0.0, 0.0]
    assert row["passed"] and "informational" in row["detail"]
