"""manage.py checkpoint inspect|verify|export on versions registered through the store."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
import torch
from django.core.management import CommandError, call_command
from safetensors.torch import load_file, save_file

from training.versions.services import checkpoint_store, policy_register

pytestmark = pytest.mark.django_db


def _folder(path: Path, scale: float) -> Path:
    path.mkdir(parents=True)
    torch.manual_seed(0)
    weights = {"w": torch.randn(64, 64), "b": torch.zeros(64)}
    weights["w"][:2] += scale
    save_file(weights, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return path


def _call(*args) -> str:
    out = StringIO()
    call_command("checkpoint", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def two_versions(creds, tmp_path, settings):
    settings.FLYWHEEL_CHECKPOINT_DIR = tmp_path / "store"
    v1 = policy_register(creds.project, _folder(tmp_path / "a", 0.0), state="production")
    v2 = policy_register(creds.project, _folder(tmp_path / "b", 0.5), parent=v1)
    return v1, v2


def test_inspect_verify_and_export_a_delta_version(two_versions, tmp_path):
    _, v2 = two_versions
    info = json.loads(_call("inspect", "acme:v2"))
    assert info["kind"] == "delta" and len(info["chain_to_full_snapshot"]) == 2 and info["ratio"] > 1
    assert "OK" in _call("verify", v2.manifest_hash)
    out = Path(_call("export", "acme:v2", str(tmp_path / "export")).strip())
    assert torch.equal(load_file(out / "model.safetensors")["w"], load_file(tmp_path / "b" / "model.safetensors")["w"])


def test_a_flipped_byte_is_refused(two_versions):
    _, v2 = two_versions
    store = checkpoint_store()
    blob_key = store.manifest(v2.manifest_hash)["blob"]
    path = next(p for p in Path(store.storage.root).rglob("*") if p.is_file() and blob_key in p.name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CommandError, match="refused"):
        _call("verify", "acme:v2")


def test_an_unknown_version_says_what_to_check(two_versions):
    with pytest.raises(CommandError, match="project slug"):
        _call("inspect", "acme:v9")
