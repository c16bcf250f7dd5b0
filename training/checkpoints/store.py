"""Content-addressed checkpoint store: full snapshots every K versions, verified deltas between.

No Django here: Django services and the inference engine call it.

    from training.checkpoints import CheckpointStore, LocalStorage
    store = CheckpointStore(LocalStorage("var/checkpoints"), full_every=8)
    h0 = store.put("path/to/hf_folder")                 # full snapshot (version 0)
    h1 = store.put(model.state_dict(), parent_hash=h0)  # delta; config/tokenizer inherited
    store.materialise(h1, "var/serve/v1")               # HF folder: transformers/vLLM load it
    state = store.load_state_dict(h1)                   # same chain walk, in memory
    info = store.manifest(h1)                           # kind, parent, depth, sizes, hashes
    h2 = store.put_adapter("path/to/peft_adapter", base_hash=h0)  # LoRA: the adapter only
    store.materialise(h2, "var/adapter")                # adapter_model.safetensors + adapter_config.json

Every object (delta/full blob, config and tokenizer files, version manifests) is stored under
the SHA-256 of its bytes; a version is named by the hash of its manifest JSON, so a hash names
exactly one checkpoint and its whole ancestry. `put` writes a full snapshot when there is no
parent or the parent is `full_every - 1` deltas away from its snapshot, else a delta
(`kernels.delta`). `materialise` walks the chain from the snapshot, checks every object hash,
every tensor hash and every parent link, and writes into a temporary folder that is renamed to
`out_dir` only once complete: a mismatch, truncation or missing link raises
`CheckpointCorrupt` (or its subclass `CheckpointMissing`) and leaves `out_dir` untouched.

A LoRA version is kind "adapter": its blob holds only the adapter's tensors (PEFT's names), its
files only `adapter_config.json`, and `base` names the manifest of the weights it sits on (one
stored base per project; every adapter of it points at the same objects). `verify` checks the
base's chain too; `materialise` writes PEFT's folder (`training.rl.lora.merge_adapter` merges it).

`Storage` is the backend interface (an S3-compatible one can follow); `make_storage(url)` picks
one from a config value. Tests: `.venv/bin/python -m pytest tests/training/checkpoints/test_checkpoint_store.py -q -p no:django`
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.delta import CheckpointCorrupt, decode, encode, read_manifest

FORMAT = "flywheel.checkpoint/2"  # /1 named the checkpoint hash `checkpoint_sha256`; still read
_FORMAT_1 = "flywheel.checkpoint/1"
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's file name: an adapter folder loads as PEFT's
DEFAULT_FULL_EVERY = 8
# Weight files are re-encoded; everything else in an HF folder (config, tokenizer, chat template)
# is kept byte for byte. Sharded-index files would point at shards we don't write.
_SKIP_FILES = {WEIGHTS, "model.safetensors.index.json"}

StateDict = Mapping[str, torch.Tensor]


class CheckpointMissing(CheckpointCorrupt):
    """An object of the chain (manifest, blob or file) is not in the storage."""


class CheckpointWriteError(OSError):
    """The storage could not take an object (a full disk, a read-only mount); nothing was kept."""


# --- storage --------------------------------------------------------------------------------


class Storage(ABC):
    """Immutable blobs addressed by the SHA-256 hex of their bytes."""

    @abstractmethod
    def put(self, data: bytes) -> str: ...

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes stored under key; CheckpointMissing if absent, CheckpointCorrupt if altered."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalStorage(Storage):
    """Objects as files `root/objects/ab/<hash>`, written atomically (temp file + rename)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a SHA-256 hex key: {key!r}")
        return self.root / "objects" / key[:2] / key

    def put(self, data: bytes) -> str:
        key = _sha(data)
        path = self._path(key)
        if path.exists():
            return key
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # a crash after the rename never leaves a short object
            os.replace(tmp, path)  # readers never see a half-written object
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise CheckpointWriteError(exc.errno, f"could not write a {len(data)}-byte checkpoint object to "
                                       f"{self.root}: {exc.strerror or exc}") from exc
        return key

    def get(self, key: str) -> bytes:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            raise CheckpointMissing(f"object {key[:12]} is missing from {self.root}") from None
        if _sha(data) != key:
            raise CheckpointCorrupt(f"object {key[:12]} in {self.root} does not match its hash (truncated or altered)")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).exists()


def make_storage(url: str | os.PathLike[str]) -> Storage:
    """Storage for a config value: a path or file:// URL (S3 would be s3://bucket/prefix)."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalStorage(text.removeprefix("file://"))
    if "://" in text:
        raise ValueError(f"no storage backend for {text!r}; supported: a path or file:// URL")
    return LocalStorage(text)


# --- store ----------------------------------------------------------------------------------


def _read_source(source: StateDict | str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """State dict and side files (config, tokenizer) from a state dict or an HF folder."""
    if isinstance(source, Mapping):
        return dict(source), {}
    folder = Path(source)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    return state, {k: v for k, v in files.items() if k not in _SKIP_FILES}


class CheckpointStore:
    """put / materialise / load_state_dict / manifest over a Storage."""

    def __init__(self, storage: Storage, full_every: int = DEFAULT_FULL_EVERY) -> None:
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        self.storage = storage
        self.full_every = full_every

    def manifest(self, manifest_hash: str) -> dict[str, Any]:
        """The verified version manifest (kind, parent, depth, blob, files, sizes, meta)."""
        data = self.storage.get(manifest_hash)
        try:
            manifest = json.loads(data)
        except ValueError as e:
            raise CheckpointCorrupt(f"manifest {manifest_hash[:12]} is not JSON: {e}") from e
        if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, _FORMAT_1):
            raise CheckpointCorrupt(f"object {manifest_hash[:12]} is not a checkpoint manifest")
        if manifest["format"] == _FORMAT_1 and "checkpoint_sha256" in manifest:
            manifest["checkpoint_hash"] = manifest.pop("checkpoint_sha256")
        return manifest

    def put(
        self,
        source: StateDict | str | os.PathLike[str],
        parent_hash: str | None = None,
        full_every: int | None = None,
        files: Mapping[str, bytes] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Store a version; returns its manifest hash.

        source: a state dict or an HF folder. files: side files (config.json, tokenizer...);
        default: the folder's, else inherited from the parent. meta: JSON-able notes kept in the
        manifest (run id, step...). A full snapshot is written when depth would reach full_every.
        """
        state, folder_files = _read_source(source)
        parent = self.manifest(parent_hash) if parent_hash else None
        every = full_every or self.full_every
        # Full weights are never a delta against an adapter (other tensors): a full snapshot then.
        as_delta = parent is not None and parent["kind"] != "adapter" and parent["depth"] + 1 < every
        parent_state = self.load_state_dict(parent_hash) if as_delta and parent_hash else None
        blob = encode(state, parent_state, parent_hash=parent["checkpoint_hash"] if as_delta and parent else None)
        side = dict(files or folder_files or {})
        inherited = parent["files"] if parent and not side and parent["kind"] != "adapter" else {}
        manifest = {
            "format": FORMAT,
            "kind": "delta" if as_delta else "full",
            "parent": parent_hash,
            "depth": parent["depth"] + 1 if as_delta and parent else 0,
            "version": parent["version"] + 1 if parent else 0,
            "blob": self.storage.put(blob),
            "blob_bytes": len(blob),
            "raw_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "checkpoint_hash": _blob_checkpoint_hash(blob),
            "files": {**inherited, **{name: self.storage.put(data) for name, data in side.items()}},
            "meta": dict(meta or {}),
        }
        return self.storage.put(json.dumps(manifest, sort_keys=True, indent=1).encode())

    def put_adapter(self, folder: str | os.PathLike[str], base_hash: str, meta: Mapping[str, Any] | None = None
                    ) -> str:
        """Store a PEFT adapter folder as a version over the stored weights `base_hash`; returns
        its manifest hash. Only the adapter is written (its tensors, adapter_config.json): the
        base is the object already stored, and `base_raw_bytes` lets the registry show the ratio."""
        base = self.manifest(base_hash)
        if base["kind"] == "adapter":
            raise ValueError("an adapter's base must be full weights, not another adapter")
        path = Path(folder)
        state = dict(load_file(path / ADAPTER_WEIGHTS))
        blob = encode(state, None)
        files = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file() and p.suffix != ".safetensors"}
        manifest = {
            "format": FORMAT, "kind": "adapter", "parent": None, "depth": 0, "version": base["version"] + 1,
            "base": base_hash, "base_raw_bytes": base["raw_bytes"],
            "blob": self.storage.put(blob), "blob_bytes": len(blob),
            "raw_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "checkpoint_hash": _blob_checkpoint_hash(blob),
            "files": {name: self.storage.put(data) for name, data in files.items()},
            "meta": dict(meta or {}),
        }
        return self.storage.put(json.dumps(manifest, sort_keys=True, indent=1).encode())

    def _chain(self, manifest_hash: str) -> list[dict[str, Any]]:
        """Manifests from the full snapshot down to manifest_hash, links checked."""
        chain = [self.manifest(manifest_hash)]
        while chain[-1]["kind"] == "delta":
            parent = chain[-1]["parent"]
            if not parent:
                raise CheckpointCorrupt("a delta manifest has no parent")
            chain.append(self.manifest(parent))
            if len(chain) > 10_000:
                raise CheckpointCorrupt("delta chain does not end in a full snapshot")
        return chain[::-1]

    def verify(self, manifest_hash: str) -> dict[str, Any]:
        """Checks that every object of the version's chain is present and holds the bytes its hash
        names (manifests, links, blobs, side files) without decoding any tensor; returns the
        manifest. CheckpointCorrupt / CheckpointMissing say which object is wrong."""
        chain = self._chain(manifest_hash)
        for manifest in chain:
            blob = self.storage.get(manifest["blob"])
            if _blob_checkpoint_hash(blob) != manifest["checkpoint_hash"]:
                raise CheckpointCorrupt("blob does not hold the checkpoint its manifest names")
            for key in manifest["files"].values():
                self.storage.get(key)
        if chain[-1]["kind"] == "adapter":  # an adapter is served merged into its base: both must be whole
            self.verify(chain[-1]["base"])
        return chain[-1]

    def load_state_dict(self, manifest_hash: str) -> dict[str, torch.Tensor]:
        """Walk the chain, verifying every blob, tensor and link; returns the state dict."""
        state: dict[str, torch.Tensor] | None = None
        known: str | None = None
        for manifest in self._chain(manifest_hash):
            blob = self.storage.get(manifest["blob"])
            if _blob_checkpoint_hash(blob) != manifest["checkpoint_hash"]:
                raise CheckpointCorrupt("blob does not hold the checkpoint its manifest names")
            state = decode(blob, state, parent_hash=known)
            known = manifest["checkpoint_hash"]
        assert state is not None
        return state

    def materialise(self, manifest_hash: str, out_dir: str | os.PathLike[str]) -> Path:
        """Write the version as an HF folder (model.safetensors + side files); atomic."""
        out = Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty")
        state = self.load_state_dict(manifest_hash)
        files = {name: self.storage.get(key) for name, key in self.manifest(manifest_hash)["files"].items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        try:
            weights = ADAPTER_WEIGHTS if self.manifest(manifest_hash)["kind"] == "adapter" else WEIGHTS
            save_file({k: v.contiguous() for k, v in state.items()}, tmp / weights, metadata={"format": "pt"})
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            _publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; a concurrent writer that got there first wins."""
    try:
        if out.exists():
            out.rmdir()  # empty (checked by the caller); fails if another writer filled it
        os.replace(tmp, out)
    except OSError as e:
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} was written concurrently") from e
        raise


def _blob_checkpoint_hash(blob: bytes) -> str:
    return str(read_manifest(blob)["checkpoint_hash"])
