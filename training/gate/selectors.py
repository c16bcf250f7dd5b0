"""Reads of the gate: the project's reference (its base), the names its code uses, and the base's
measurements a previous gate run stored.

    .venv/bin/python -m pytest tests/training/gate/test_gate_naturalness.py -q
"""

from __future__ import annotations

from typing import Any

from feedback.models import Project, Trajectory
from training.corpora.selectors import corpus_known_names, corpus_latest
from training.gate.config import SuiteSpec
from training.models import AuditLog, GateReport, PolicyVersion
from training.rewards.usefulness import known_names

KNOWN_NAMES_TRAJECTORIES = 5000  # the newest prompts read for the project's names


def gate_reference(project: Project) -> PolicyVersion | None:
    """The project's reference: the base the naturalness rows read a candidate's text under and whose
    measurements set the derived thresholds. The newest version installed as a base
    (`base_policy_install`: bootstrap_policy, a registered HF folder) or mid-trained and promoted
    (a TrainingRun of kind midtrain), else the project's first version."""
    target = (AuditLog.objects.filter(project=project, action="install_base", target__startswith="policy_version:")
              .order_by("-seq").values_list("target", flat=True).first())
    installed = (PolicyVersion.objects.filter(project=project, pk=int(target.split(":", 1)[1])).first()
                 if target is not None else None)
    # A mid-trained version a person promoted is the project's base from then on.
    midtrained = (PolicyVersion.objects.filter(project=project, config__kind="midtrain",
                                               state__in=("production", "retired")).order_by("-number").first())
    newest = max((v for v in (installed, midtrained) if v is not None), key=lambda v: v.number, default=None)
    return newest or PolicyVersion.objects.filter(project=project).order_by("number").first()


def gate_known_names(project: Project, spec: SuiteSpec) -> frozenset[str]:
    """The names a suggestion may use without inventing one: those of the project's code the gate can
    see (the suite's prompts and check inputs, the newest trajectories' prompts) and the language's.
    The one place to point at the project's corpus once it has one."""
    texts = [p.prompt for p in spec.prompts]
    texts += [v for p in spec.prompts for v in p.context.values() if isinstance(v, str)]
    prompts = (Trajectory.objects.filter(project=project).order_by("-occurred_at")
               .values_list("prompt", flat=True)[:KNOWN_NAMES_TRAJECTORIES])
    texts += [m["content"] for messages in prompts for m in messages or []
              if isinstance(m, dict) and isinstance(m.get("content"), str)]
    corpus = corpus_latest(project)
    return known_names(texts) | (corpus_known_names(corpus) if corpus is not None else frozenset())


def gate_base_measured(project: Project, key: str) -> dict[str, Any] | None:
    """The base's measurements a previous gate run of the project stored under `key` (the reference
    version, the suite version and its sampling), or None: measure them now."""
    policy = (GateReport.objects.filter(version__project=project, policy__base__key=key)
              .order_by("-created_at").values_list("policy", flat=True).first())
    return policy["base"]["measure"] if policy else None
