"""Checkpoint faults: a truncated or corrupted delta, a missing link of the chain, a full disk
while the candidate is written. Each is refused with an error that says what is wrong,
production is untouched, the candidate is marked failed (rejected, audited), and the serving
process keeps serving the version it has.

    .venv/bin/python -m pytest tests/training/checkpoints/test_checkpoint_faults.py -q
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import Conflict
from kernels.delta import CheckpointCorrupt
from training.checkpoints.store import CheckpointMissing
from training.models import AuditLog, EvalSuite, PolicyVersion, TrainingRun
from training.promotion.services import candidate_promote
from training.runs.settings import RunSettings
from training.versions.selectors import policy_production
from training.versions.services import checkpoint_store, policy_folder, policy_register

pytestmark = pytest.mark.django_db


def variant(source: Path, out: Path, seed: int) -> Path:
    """The policy with one tensor nudged: a checkpoint (and delta blob) no other test shares."""
    shutil.copytree(source, out)
    state = load_file(out / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name] + 1e-3 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(seed))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def object_path(key: str) -> Path:
    from django.conf import settings

    return Path(settings.FLYWHEEL_CHECKPOINT_DIR) / "objects" / key[:2] / key


def blob_of(version: PolicyVersion) -> Path:
    return object_path(checkpoint_store().manifest(version.manifest_hash)["blob"])


def actions(version: PolicyVersion) -> list[str]:
    return list(AuditLog.objects.filter(target=f"policy_version:{version.id}").order_by("at", "id")
                .values_list("action", flat=True))


def test_a_truncated_delta_is_refused_at_approval_and_production_keeps_serving(
    creds, production, tiny_policy_dir, tmp_path, alice
):
    v2 = policy_register(creds.project, variant(tiny_policy_dir, tmp_path / "v2", 1), parent=production,
                         state="awaiting_approval")
    blob = blob_of(v2)
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])

    with pytest.raises(Conflict, match="checkpoint is refused.*does not match its hash.*v1 stays in production"):
        candidate_promote(v2.pk, alice, "approve", "passed the gate")
    v2.refresh_from_db()
    assert v2.state == "rejected" and actions(v2) == ["checkpoint_refused"]
    assert policy_production(creds.project) == production


def test_a_corrupted_delta_is_refused_by_the_gate_and_marked_failed(creds, production, tiny_policy_dir, tmp_path):
    from training.gate.services import gate_run

    EvalSuite.objects.create(project=creds.project, version=1, prompts=[{"id": "p0", "prompt": "import os"}],
                             checks=[], judge={"kind": "rule_rubric", "aspects": ["concision"]},
                             aspects=[{"name": "concision", "weight": 1.0}], n_samples=1, max_tokens=4)
    v2 = policy_register(creds.project, variant(tiny_policy_dir, tmp_path / "v2", 2), parent=production)
    blob = blob_of(v2)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the delta
    blob.write_bytes(bytes(data))

    with pytest.raises(CheckpointCorrupt, match="does not match its hash"):
        gate_run(v2.pk)
    v2.refresh_from_db()
    assert v2.state == "rejected" and actions(v2) == ["gate_start", "checkpoint_refused"]
    assert policy_production(creds.project) == production


@pytest.mark.django_db(transaction=True)  # the serving process's resolver closes old connections, as it must
def test_a_missing_link_is_refused_and_the_serving_process_keeps_its_version(
    creds, production, tiny_policy_dir, tmp_path, alice
):
    from inference.engines import make_engine
    from inference.serving import PolicyServer, ServingError
    from training.management.commands.serve_policy import _resolver

    v2 = policy_register(creds.project, variant(tiny_policy_dir, tmp_path / "v2", 3), parent=production,
                         state="retired")
    v3 = policy_register(creds.project, variant(tiny_policy_dir, tmp_path / "v3", 4), parent=v2,
                         state="awaiting_approval")
    object_path(v2.manifest_hash).unlink()  # the link between v3 and the snapshot is gone
    server = PolicyServer(creds.project.slug, make_engine("torch", policy_folder(production), version=1),
                          recorder=None, resolve=_resolver(creds.project))

    with pytest.raises(ServingError, match="v3's checkpoint is refused.*missing") as refused:
        server.load({"version": 3})
    assert refused.value.status == 409
    assert server.engine.version == 1  # still serving what it had
    with pytest.raises(Conflict, match="is missing"):
        candidate_promote(v3.pk, alice, "approve", "passed the gate")
    v3.refresh_from_db()
    assert v3.state == "rejected" and policy_production(creds.project) == production
    with pytest.raises(CheckpointMissing):
        checkpoint_store().verify(v3.manifest_hash)


@pytest.fixture
def full_disk(tmp_path):
    """A 4 MiB tmpfs (the machine's real ENOSPC, no patch)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"this test mounts a small tmpfs and needs root for it: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_full_disk_while_writing_the_candidate_fails_the_run_and_keeps_nothing(
    creds, production, tokenizer, full_disk, settings
):
    from tests.training.test_services import ingest_live, later, plain_spec
    from training.rewards.services import rewards_compute_pending
    from training.runs.services import train_policy, training_run_start

    # The store on the small disk holds production's objects; then the disk is filled up.
    manifest = checkpoint_store().manifest(production.manifest_hash)
    for key in [production.manifest_hash, manifest["blob"], *manifest["files"].values()]:
        target = full_disk / "objects" / key[:2] / key
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(object_path(key), target)
    settings.FLYWHEEL_CHECKPOINT_DIR = full_disk
    fill(full_disk)
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    run, _ = training_run_start(creds.project, RunSettings(steps=1, batch_size=2), enqueue=False)

    run = train_policy(run.pk)
    assert run.state == "failed" and run.candidate is None
    assert "No space left on device" in run.error and "could not write" in run.error
    assert list(PolicyVersion.objects.filter(project=creds.project)) == [production]
    assert policy_production(creds.project) == production
    assert not list(full_disk.glob("objects/*/.tmp-*"))  # no half-written object left behind
    assert TrainingRun.objects.get(pk=run.pk).error == run.error
