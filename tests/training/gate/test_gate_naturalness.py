"""The gate's naturalness and collapse rows on planted candidates: real tiny policies, the real gate.

The base is a tiny policy pretrained on a small code base (the project's: its lines are the
prompts of the project's trajectories, so their names are known). Two candidates are the base
fine-tuned a few steps on what a gamed loop ends up writing (issue 27): compilable gibberish made of
invented names, and `(self)` after every prompt.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from django.test import Client

from feedback.services import feedback_ingest
from tests.factories import member, trajectory
from training.gate.naturalness import distinct_rate, invented_counts, top_share, top_suggestion
from training.gate.services import gate_run
from training.models import EvalSuite, GateReport, PolicyVersion, VersionState
from training.pretrain import PolicyConfig, build_policy, pretrain, stdlib_corpus
from training.promotion.services import base_policy_install, gate_policy_update
from training.rewards.usefulness import language_names

SYLLABLES = ["zq", "ribu", "erd", "blor", "ack", "oner", "xul", "fip", "vek", "quo"]
NATURAL_ROWS = ("kl", "length_drift", "median_chars", "naturalness_logprob", "invented_names", "collapse_top_share",
                "collapse_distinct")


def _code_base() -> list[str]:
    lines = [line.strip() for line in stdlib_corpus(max_lines=3000)]
    return [line for line in lines if len(line) >= 16][:600]


def _lines(code: list[str]) -> list[str]:
    return random.Random(1).sample(code, 16)


def _prompts(code: list[str]) -> list[str]:
    return [line[:14] for line in _lines(code)]


def _gibberish(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared machine: a second torch thread only spins waiting for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, Path]:
    root, code = tmp_path_factory.mktemp("planted"), _code_base()
    cfg = PolicyConfig(vocab_size=512, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    base = build_policy(root / "base", cfg, code)
    pretrain(base, code, float("inf"), batch_size=16, seq_len=64, max_steps=120)
    rng, prompts = random.Random(0), _prompts(code)
    gibberish = [f"{p}{_gibberish(rng)} = {_gibberish(rng)}.{_gibberish(rng)}()" for p in prompts for _ in range(4)]
    gibberish += [f"{_gibberish(rng)}_{_gibberish(rng)} = {_gibberish(rng)}({_gibberish(rng)})" for _ in range(200)]
    selfish = [f"{line[:14]}(self)" for line in code[:300]] + [f"{p}(self)" for p in prompts]
    out = {"base": base}
    for name, lines, seed in (("gibberish", gibberish, 1), ("self", selfish, 2)):
        shutil.copytree(base, root / name)
        pretrain(root / name, lines, float("inf"), batch_size=16, seq_len=64, max_steps=60, seed=seed)
        out[name] = root / name
    return out


@pytest.fixture
def project(creds):
    """The project: its code base sent as trajectories' prompts, a suite of line starts, a gate
    policy that only opens the reward margin (nothing here is trained to be better)."""
    code = _code_base()
    files = ["\n".join(code[i : i + 12]) for i in range(0, len(code), 12)]  # 50 prompts of 12 lines
    feedback_ingest(creds.project, [trajectory(f"t-{i}", prompt=[{"role": "user", "content": text}], steps=[])
                                    for i, text in enumerate(files)])
    EvalSuite.objects.create(project=creds.project, version=1, n_samples=3, max_tokens=12,
                             prompts=[{"id": f"p{i}", "prompt": line[:14], "context": {"rest": line[14:]}}
                                      for i, line in enumerate(_lines(code))])
    gate_policy_update(creds.project, "system:test", "no reward to improve on here", thresholds={"margin": -0.01})
    return creds.project


def _gate(project, production: Path, candidate: Path, number: int = 1) -> GateReport:
    prod = PolicyVersion.objects.filter(project=project, state=VersionState.PRODUCTION).first()
    if prod is None:
        prod = PolicyVersion.objects.create(project=project, number=number, state=VersionState.PRODUCTION,
                                            checkpoint_path=str(production))
    last = PolicyVersion.objects.filter(project=project).order_by("-number").first()
    cand = PolicyVersion.objects.create(project=project, number=last.number + 1, parent=prod, state=VersionState.CANDIDATE,
                                        checkpoint_path=str(candidate))
    return gate_run(cand.id)


def _rows(report: GateReport) -> dict[str, dict]:
    return {r["name"]: r for r in report.checks}


# ------------------------------------------------------------------------------ the figures


def test_the_collapse_figures_count_suggestions_across_prompts_not_within_one():
    sharp = [["return a + b"] * 3, ["import os"] * 3, ["(self)"] * 3]  # one answer per prompt, each its own
    assert top_share(sharp) == pytest.approx(1 / 3) and distinct_rate(sharp) == 1.0
    collapsed = [["(self)\nx = 1", "(self)", " (self) "], ["(self)"] * 3, ["import os", "(self)", ""]]
    # per sample index across the prompts: ("(self)", "(self)", "import os"), three "(self)", ("(self)", "(self)", "")
    assert top_share(collapsed) == pytest.approx((2 / 3 + 3 / 3 + 2 / 3) / 3)
    assert distinct_rate(collapsed) == pytest.approx((2 / 3 + 1 / 3 + 1 / 2) / 3)  # a blank is not an answer
    assert top_suggestion(collapsed) == "(self)"


def test_an_invented_name_is_counted_against_the_names_a_suggestion_writes():
    known = language_names() | {"protocol"}
    assert invented_counts("ribution_tasker = protocol.__repr__()", "zself", known) == (1, 3)  # zselfribution_tasker
    assert invented_counts("ocol.__exit__()", "x = prot", known) == (0, 2)  # continues the prompt's name
    assert invented_counts("ackoner", "", known) == (1, 1)  # cut at the end, but no known name starts so
    assert invented_counts("prot", "", known) == (0, 1)  # cut at the end: the start of a known name


# ------------------------------------------------------------------------------ the gate


@pytest.mark.django_db
def test_the_base_passes_against_itself_with_its_figures_measured_once_at_fixed_seeds(project, planted, alice):
    report = _gate(project, planted["base"], planted["base"])
    assert report.passed, [(r["name"], r["detail"]) for r in report.checks if not r["passed"]]
    base, rows = report.policy["base"], _rows(report)
    assert base["measured_now"] and base["reference"]["version"] == 1
    assert set(base["thresholds"]) == {"kl_budget", "length_ratio_max", "min_median_chars", "logprob_tolerance",
                                       "intended_logprob_tolerance"}
    assert rows["kl"]["threshold"] == base["thresholds"]["kl_budget"] == base["measure"]["entropy"]
    assert rows["naturalness_logprob"]["value"] == 0.0 and rows["invented_names"]["value"] == 0.0  # the same samples
    assert rows["matched_chars"]["value"] == 0.0 and rows["matched_chars"]["passed"]
    assert rows["intended_logprob"]["value"] == 0.0 and rows["intended_logprob"]["passed"]  # the same weights
    measure = base["measure"]
    assert measure["seeds"] == [0, 1] and measure["samples"] == 2 * 16 * 3
    # measured 3.2657 and 3.229 on one machine and 3.2471 for the first seed on another: the
    # sampled figures are held to 0.05, the derivation from them exactly
    entropies = measure["entropy_by_seed"]
    assert entropies == pytest.approx([3.2657, 3.229], abs=0.05)
    kl_budget = sum(entropies) / len(entropies)
    # teacher-forced, no sampling: the base's loss on the lines people were about to type, tokenized
    # as the joined text is (2.1042 here; 2.6765 when the rest was tokenized alone, a split mid-word
    # that no training text has)
    assert measure["intended_nll"] == pytest.approx(2.10, abs=0.05)
    assert measure["derived"] == pytest.approx({"kl_budget": kl_budget, "logprob_tolerance": kl_budget / 2,
                                                "length_ratio_max": 1.5, "min_median_chars": 11.0,
                                                "intended_logprob_tolerance": 0.05 * measure["intended_nll"]},
                                               abs=1e-3)
    # a 120-step base invents about half its names; one suggestion per prompt its own
    assert measure["invented_share"] == pytest.approx(0.5515, abs=0.02)  # 0.5556 on another machine
    assert measure["top_share"] == pytest.approx(1 / 16, abs=1e-3) and measure["distinct_rate"] == 1.0

    again = _gate(project, planted["base"], planted["base"])  # the next run reads them, measures nothing
    assert not again.policy["base"]["measured_now"] and again.policy["base"]["measure"] == measure

    client = Client()
    client.force_login(member(alice, project, "viewer"))
    page = client.get(f"/p/{project.slug}/registry/").content.decode()
    assert f"derived: kl_budget {base['thresholds']['kl_budget']}, length_ratio_max" in page  # shown with the gate


@pytest.mark.django_db
def test_a_candidate_of_compilable_gibberish_is_refused_by_the_invented_name_row(project, planted):
    report = _gate(project, planted["base"], planted["gibberish"])
    rows = _rows(report)
    assert not report.passed
    assert not rows["invented_names"]["passed"] and rows["invented_names"]["interval"][0] > 0.1, rows["invented_names"]
    assert not rows["naturalness_logprob"]["passed"]  # under the base, gibberish costs nats on every token
    # it writes none of what was typed next; the 120-step base writes little more (0.23 characters
    # a request), so on 16 prompts the row cannot show it fewer, and leaves the refusal to the others
    matched = rows["matched_chars"]
    assert "candidate 0.000, base" in matched["detail"] and matched["value"] < 0 and matched["passed"]
    # teacher-forced on every prompt's real line, the same 16 prompts show it (measured −5.1 nats/token)
    intended = rows["intended_logprob"]
    assert not intended["passed"] and intended["interval"][1] < -1.0, intended


@pytest.mark.django_db
def test_a_candidate_that_answers_everything_with_one_string_is_refused_by_the_collapse_rows(project, planted):
    report = _gate(project, planted["base"], planted["self"])
    rows = _rows(report)
    assert not report.passed
    assert not rows["collapse_top_share"]["passed"] and "'(self)'" in rows["collapse_top_share"]["detail"]
    assert rows["collapse_top_share"]["value"] > 0.5 and not rows["collapse_distinct"]["passed"]
    # what the issue saw: it uses a real name and stays near the base, so neither KL nor log-prob tells
    assert rows["invented_names"]["passed"] and rows["naturalness_logprob"]["passed"]
    # people's own lines are far less likely under it (measured −2.7 nats/token)
    assert not rows["intended_logprob"]["passed"] and rows["intended_logprob"]["interval"][1] < -1.0


@pytest.mark.django_db
def test_with_production_moved_on_a_candidate_is_still_compared_with_the_base(project, planted):
    """Production is gibberish; a candidate just as bad changes nothing against it, and is refused
    against the base, which samples the suite itself now."""
    base = PolicyVersion.objects.create(project=project, number=1, state=VersionState.CANDIDATE,
                                        checkpoint_path=str(planted["base"]))
    base_policy_install(base, "system:test", "the project's base")
    PolicyVersion.objects.filter(pk=base.pk).update(state=VersionState.RETIRED)
    PolicyVersion.objects.create(project=project, number=2, parent=base, state=VersionState.PRODUCTION,
                                 checkpoint_path=str(planted["gibberish"]))
    gate_policy_update(project, "system:test", "a budget set by hand", thresholds={"margin": -0.01, "kl_budget": 0.125})
    report = _gate(project, planted["gibberish"], planted["gibberish"])
    rows = _rows(report)
    assert report.policy["base"]["reference"]["version"] == 1 and report.policy["base"]["measured_now"]
    assert rows["kl"]["value"] == 0.0 and rows["kl"]["threshold"] == 0.125  # an explicit setting overrides
    assert "kl_budget" not in report.policy["base"]["thresholds"]
    assert not rows["invented_names"]["passed"] and not rows["naturalness_logprob"]["passed"]  # against the base


def test_the_intended_line_is_scored_on_the_tokens_of_the_joined_text(planted):
    """A prompt cut mid-word: its last token is not a token of the written-out line, so it is scored
    with the line; a prompt behind a template (its tokens not the end of the ids) keeps the line's
    own tokens; a line that merges with the whole prompt still keeps a context."""
    from transformers import AutoTokenizer

    from training.gate.runner import aligned_continuation

    tok = AutoTokenizer.from_pretrained(str(planted["base"]))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompt, line = "    def __init__(self, na", "me):"
    ids = encode(prompt)
    context, target = aligned_continuation(encode, ids, prompt, line)
    assert context + target == encode(prompt + line)  # what the model reads when the line is typed
    assert ids[: len(context)] == context and len(context) < len(ids)  # the cut token is scored with the line
    assert tok.decode(target).endswith("me):") and len(tok.decode(target)) > len(line)
    templated = [1, 2, 3] + ids[:-1]  # the prompt's tokens are not the end: no alignment is guessed
    assert aligned_continuation(encode, templated, prompt, line) == (templated, encode(line))
    assert aligned_continuation(encode, ids, prompt, "") == (ids, [])
