"""Checkpoint store: round trips through full snapshots and deltas, refuses corruption and
missing links without writing anything, and writes HF folders that transformers loads.

Run: `.venv/bin/python -m pytest tests/training/checkpoints/test_checkpoint_store.py -q`
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from training.checkpoints import (
    CheckpointCorrupt,
    CheckpointMissing,
    CheckpointStore,
    LocalStorage,
    make_storage,
)

WORDS = ["def", "add", "(", ")", ":", "return", "a", "b", "+", ","]


def _tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def _save_hf_folder(model: Qwen2ForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    return folder


def _step(model: Qwen2ForCausalLM, seed: int) -> dict[str, torch.Tensor]:
    """A small update that changes a fraction of the bf16 weights, like an optimizer step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 2e-5)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(LocalStorage(tmp_path / "checkpoints"), full_every=3)


@pytest.fixture
def chain(store: CheckpointStore, tmp_path: Path) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    model = _tiny_model()
    hashes = [store.put(_save_hf_folder(model, tmp_path / "hf0"))]
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for seed in range(1, 5):
        states.append(_step(model, seed))
        hashes.append(store.put(states[-1], parent_hash=hashes[-1], meta={"step": seed}))
    return hashes, states


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() <= b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_it_writes_a_full_snapshot_every_k_versions_and_deltas_between(store: CheckpointStore, chain) -> None:  # noqa: ANN001
    hashes, states = chain
    kinds = [store.manifest(h)["kind"] for h in hashes]
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    for h, state in zip(hashes, states, strict=True):
        assert _equal(store.load_state_dict(h), state)
    delta = store.manifest(hashes[1])
    assert delta["blob_bytes"] < delta["raw_bytes"] / 2
    assert store.manifest(hashes[4])["meta"] == {"step": 4}


def test_the_materialised_folder_loads_in_transformers(store: CheckpointStore, chain, tmp_path: Path) -> None:  # noqa: ANN001
    hashes, states = chain
    out = store.materialise(hashes[2], tmp_path / "serve" / "v2")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(out)
    assert _equal(states[2], {k: v for k, v in model.state_dict().items()})
    ids = tok("def add ( a , b ) :", return_tensors="pt").input_ids  # (1, T)
    assert ids.shape[1] >= 7 and 0 < int(ids.min()) and int(ids.max()) <= len(WORDS)  # no [UNK]
    assert model(ids).logits.shape == (1, ids.shape[1], 64)


@pytest.mark.parametrize("target", ["blob", "manifest", "file"])
def test_a_corrupt_object_is_refused_and_nothing_is_written(store: CheckpointStore, chain, tmp_path: Path, target: str) -> None:  # noqa: ANN001
    hashes, _ = chain
    manifest = store.manifest(hashes[1])
    key = {"blob": manifest["blob"], "manifest": hashes[0], "file": manifest["files"]["config.json"]}[target]
    path = store.storage.root / "objects" / key[:2] / key  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    out = tmp_path / "serve" / "bad"
    with pytest.raises(CheckpointCorrupt):
        store.materialise(hashes[2], out)
    assert not out.exists()
    assert not list((tmp_path / "serve").glob(".*tmp*"))


def test_a_truncated_blob_and_a_missing_link_are_refused(store: CheckpointStore, chain, tmp_path: Path) -> None:  # noqa: ANN001
    hashes, _ = chain
    blob_key = store.manifest(hashes[4])["blob"]
    blob_path = store.storage.root / "objects" / blob_key[:2] / blob_key  # type: ignore[attr-defined]
    blob_path.write_bytes(blob_path.read_bytes()[:-100])
    with pytest.raises(CheckpointCorrupt):
        store.materialise(hashes[4], tmp_path / "out4")
    (store.storage.root / "objects" / hashes[1][:2] / hashes[1]).unlink()  # type: ignore[attr-defined]
    with pytest.raises(CheckpointMissing, match="missing"):
        store.materialise(hashes[2], tmp_path / "out2")
    assert not (tmp_path / "out4").exists() and not (tmp_path / "out2").exists()
    assert _equal(store.load_state_dict(hashes[3]), store.load_state_dict(hashes[3]))  # own snapshot: fine


def test_it_refuses_a_non_empty_target_and_unknown_storage_urls(store: CheckpointStore, chain, tmp_path: Path) -> None:  # noqa: ANN001
    hashes, _ = chain
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(FileExistsError):
        store.materialise(hashes[0], tmp_path / "busy")
    assert isinstance(make_storage(f"file://{tmp_path}"), LocalStorage)
    with pytest.raises(ValueError, match="no storage backend"):
        make_storage("s3://bucket/prefix")


def test_the_store_never_imports_django() -> None:
    code = "import sys, training.checkpoints, kernels.delta; assert 'django' not in sys.modules, 'django'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_an_adapter_is_stored_alone_over_its_base_and_verified_with_it(store: CheckpointStore, chain,  # noqa: ANN001
                                                                      tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hashes, _ = chain
    folder = tmp_path / "adapter"
    folder.mkdir()
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4)}
    save_file(lora, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    adapter = store.put_adapter(folder, base_hash=hashes[0])
    manifest = store.manifest(adapter)
    assert (manifest["kind"], manifest["base"]) == ("adapter", hashes[0])
    assert manifest["raw_bytes"] == 2 * 4 * 32 * 4 and manifest["base_raw_bytes"] == store.manifest(hashes[0])["raw_bytes"]
    out = store.materialise(adapter, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(torch.equal(store.load_state_dict(adapter)[k], v) for k, v in lora.items())
    with pytest.raises(ValueError, match="must be full weights"):
        store.put_adapter(folder, base_hash=adapter)
    # Full weights after an adapter are a full snapshot, never a delta against the adapter's tensors.
    assert store.manifest(store.put(_tiny_model().state_dict(), parent_hash=adapter))["kind"] == "full"
    # The adapter is served merged into its base: a damaged base refuses the adapter too.
    blob = store.manifest(hashes[0])["blob"]
    path = store.storage._path(blob)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointCorrupt):
        store.verify(adapter)
