"""Mid-training: packed rows, a run on the tiny policy at fixed seeds (the loss falls, a candidate
through the same path as RL runs), the command's progress bar, the API, a registered HF folder.

    .venv/bin/python -m pytest tests/training/runs/test_midtrain.py -q
"""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
import torch
from django.core.management import call_command
from transformers import AutoModelForCausalLM

from feedback.services import api_key_create, service_account_get
from tests.factories import member
from training.corpora.packing import pack_rows
from training.corpora.services import corpus_add_paths
from training.models import PolicyVersion, TrainingRun, TrainingStep
from training.runs.midtrain import corpus_rows
from training.runs.services import midtrain_start, train_policy
from training.versions.services import policy_folder

pytestmark = pytest.mark.django_db

# A code base the stdlib-trained tiny policy never saw: its own names and idioms, over and over.
CODE = '''class Ledger{i}:
    def __init__(self, flywheel_owner, quanta):
        self.flywheel_owner = flywheel_owner
        self.quanta = list(quanta)

    def settle_quanta(self, rate):
        return sum(q * rate for q in self.quanta) + {i}
'''


@pytest.fixture
def code_base(settings, tmp_path) -> Path:
    settings.FLYWHEEL_CORPUS_DIR = tmp_path / "store"
    root = tmp_path / "code"
    root.mkdir()
    for i in range(24):
        (root / f"ledger_{i}.py").write_text(CODE.replace("{i}", str(i)))
    return root


def test_packed_rows_have_no_padding_and_end_every_document_with_eos():
    rows = pack_rows([[5, 6, 7], [8, 9], [10, 11, 12, 13]], eos_id=0, seq_len=4)  # 3+1, 2+1, 4+1 = 12 tokens
    assert rows.tolist() == [[5, 6, 7, 0], [8, 9, 0, 10], [11, 12, 13, 0]]
    assert pack_rows([[1] * 9], eos_id=0, seq_len=4).shape == (2, 4)  # the last partial row is dropped
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_rows([[1]], eos_id=0, seq_len=8)


def _row_loss(folder: Path, rows: torch.Tensor) -> float:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def test_a_midtrain_run_lowers_the_loss_and_its_candidate_takes_the_rl_path(creds, production, code_base):
    corpus = corpus_add_paths(creds.project, [str(code_base)])
    run, created = midtrain_start(creds.project, steps=40, batch_size=4, seq_len=64, lr=3e-3, enqueue=False)
    assert created and run.kind == "midtrain" and run.base_version == production
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    steps = list(TrainingStep.objects.filter(run=run).order_by("step"))
    assert len(steps) == 40 and all(s.tokens_per_s > 0 for s in steps)
    first, last = sum(s.loss for s in steps[:5]) / 5, sum(s.loss for s in steps[-5:]) / 5
    assert last < first - 1.0, (first, last)
    candidate = run.candidate
    assert candidate.state == "candidate" and candidate.parent == production and candidate.delta_bytes
    assert candidate.config["kind"] == "midtrain" and candidate.config["midtrain"]["corpus"] == corpus.pk
    held = corpus.files.filter(heldout=True).values_list("path", flat=True)
    assert held and run.result["midtrain_tokens"] == run.result["midtrain_rows"] * 64
    rows = corpus_rows(run, type("C", (), {"corpus": corpus.pk, "seq_len": 64})(), _tokenizer(production), 128)
    assert _row_loss(policy_folder(candidate), rows) < _row_loss(policy_folder(production), rows) - 1.0
    again = train_policy(run.pk)  # a redelivered task leaves a finished run alone
    assert again.state == "succeeded" and PolicyVersion.objects.filter(project=creds.project).count() == 2


def _tokenizer(version):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(policy_folder(version)))


def test_the_command_shows_a_progress_bar_and_names_the_candidate(creds, production, code_base):
    corpus_add_paths(creds.project, [str(code_base)])
    out = StringIO()
    call_command("midtrain", "--project", creds.project.slug, "--steps", "3", "--seq-len", "32", stdout=out)
    assert "succeeded: candidate v2" in out.getvalue()
    run = TrainingRun.objects.get(kind="midtrain")
    assert run.progress == 1.0 and run.result["steps"] == 3


def test_one_run_at_a_time_and_bad_options_are_clear_errors(creds, production, code_base):
    from core.errors import BadRequest, NotFound

    with pytest.raises(NotFound, match="has no corpus"):
        midtrain_start(creds.project, steps=3, enqueue=False)
    corpus_add_paths(creds.project, [str(code_base)])
    with pytest.raises(BadRequest, match="either steps or minutes"):
        midtrain_start(creds.project, enqueue=False)
    with pytest.raises(BadRequest, match="unknown mid-training options"):
        midtrain_start(creds.project, steps=3, enqueue=False, epochs=2)
    first, _ = midtrain_start(creds.project, steps=3, enqueue=False)
    second, created = midtrain_start(creds.project, minutes=1, enqueue=False)
    assert not created and second == first  # queued and within the queue timeout: still the project's run


def test_the_api_queues_a_run_for_an_admin_and_refuses_others(client, creds, production, code_base):
    corpus_add_paths(creds.project, [str(code_base)])
    admin = api_key_create(creds.project, ["admin"], name="ops",
                           owner=member(service_account_get("ops"), creds.project, "admin"))
    reader = api_key_create(creds.project, ["read"], name="reader")

    def post(body, key):
        return client.post("/api/v1/midtrain", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")

    assert post({"minutes": 1}, reader).status_code == 403
    both = post({"minutes": 1, "steps": 3}, admin)
    assert both.status_code == 400 and "one of the two" in str(both.json())
    assert post({"steps": 3, "from_version": 9}, admin).status_code == 409
    queued = post({"steps": 3, "seq_len": 32}, admin)
    assert queued.status_code == 202, queued.json()
    assert queued.json()["kind"] == "midtrain" and queued.json()["base_version"] == 1
    busy = post({"steps": 3}, admin)
    assert busy.status_code == 409 and busy.json()["error"]["run"] == queued.json()["run"]


def test_a_registered_hugging_face_folder_is_mid_trained(creds, tmp_path, dense_dir, code_base):
    from tests.training.checkpoints.test_bootstrap_from_folder import _folder

    call_command("bootstrap_policy", "--project", creds.project.slug, "--from", str(_folder(tmp_path, "llama", dense_dir)),
                 stdout=StringIO())
    corpus_add_paths(creds.project, [str(code_base)])
    run, _ = midtrain_start(creds.project, steps=4, batch_size=2, seq_len=32, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.candidate.parent.config["model_type"] == "llama"
    config = AutoModelForCausalLM.from_pretrained(str(policy_folder(run.candidate))).config
    assert config.model_type == "llama"
