"""manage.py bootstrap_policy: a pretrained base policy in production, stored and on record."""

from __future__ import annotations

from io import StringIO

import pytest
import torch
from django.core.management import call_command
from django.utils import timezone
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.models import AuditLog, PolicyVersion
from training.versions.selectors import production_at
from training.versions.services import policy_folder

pytestmark = pytest.mark.django_db


def _bootstrap(slug: str, *extra: str) -> str:
    out = StringIO()
    call_command("bootstrap_policy", "--project", slug, "--seconds", "1", *extra, stdout=out)
    return out.getvalue()


def test_it_installs_an_audited_base_policy_and_force_replaces_it(creds, settings, tmp_path):
    settings.VAR_DIR, settings.FLYWHEEL_CHECKPOINT_DIR = tmp_path, tmp_path / "checkpoints"
    assert "registered acme v1 in production" in _bootstrap("acme")
    v1 = PolicyVersion.objects.get(project=creds.project, number=1)
    assert v1.state == "production" and v1.manifest_hash and v1.config["pretrain"]["step"] >= 1
    _assert_a_loadable_dense_policy(policy_folder(v1))
    assert production_at(creds.project, timezone.now()) == v1
    assert "already has policy v1" in _bootstrap("acme")  # idempotent without --force
    _bootstrap("acme", "--force")
    v1.refresh_from_db()
    assert v1.state == "retired"
    assert production_at(creds.project, timezone.now()).number == 2
    assert list(AuditLog.objects.filter(project=creds.project).values_list("action", flat=True).order_by("id")) == [
        "install_base", "retire", "install_base"]


def _assert_a_loadable_dense_policy(folder) -> None:
    """The folder is a whole HF policy: its own tokenizer round-trips code, and the dense (Qwen2)
    model reads it into finite next-token logits over the whole vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.config.model_type == "qwen2"
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(text, return_tensors="pt").input_ids  # (1, T)
    assert tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
