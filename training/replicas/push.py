"""What a promotion sends to a serving replica, and how the replica checks it. No Django here.

A push names one role (production or canary) and the version the database says it should serve.
It carries the version's manifest (the JSON the checkpoint store names by its SHA-256, which the
replica compares with `PolicyVersion.manifest_hash`), the delta blobs that take the replica from a
checkpoint it already holds (`base`) to that version, and the side files (config, tokenizer) that
differ from the base's. The replica decodes each blob onto the state it holds (`kernels.delta`
checks every tensor hash and the parent link), then checks the result against the manifest's
checkpoint hash and every side file against the manifest's hashes: a push that does not
reproduce exactly the version the registry names is refused, and nothing is swapped.

Container: MAGIC | u64 header length | header JSON | blobs | side files. The header lists the
blobs' and files' lengths in order, so the replica never guesses where one ends.

    body = push_encode(header, blobs, files)
    header, blobs, files = push_decode(body)
    blobs = push_plan(store, base_hash, target_hash)    # on the sender, from the checkpoint store
    state, checkpoint = push_apply(state, checkpoint, blobs)  # on the replica

Tests: `.venv/bin/python -m pytest tests/training/replicas/test_replicas.py -q`
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

import torch

from kernels.delta import CheckpointCorrupt, decode, encode, read_manifest

MAGIC = b"FWPUSH1\n"
MAX_HEADER_BYTES = 1 << 20


class PushMalformed(ValueError):
    """The body is not a push container (truncated, or lengths that do not add up)."""


def push_encode(header: dict[str, Any], blobs: list[bytes], files: Mapping[str, bytes]) -> bytes:
    head = json.dumps({**header, "blobs": [len(b) for b in blobs],
                       "files": {name: len(data) for name, data in files.items()}}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *blobs, *files.values()])


def push_decode(body: bytes) -> tuple[dict[str, Any], list[bytes], dict[str, bytes]]:
    view = memoryview(body)
    if len(view) < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise PushMalformed("not a Flywheel push (bad magic or truncated)")
    (hlen,) = struct.unpack_from("<Q", view, len(MAGIC))
    start = len(MAGIC) + 8
    if hlen > MAX_HEADER_BYTES or start + hlen > len(view):
        raise PushMalformed("the push header runs past the body")
    try:
        header = json.loads(bytes(view[start : start + hlen]))
    except ValueError as exc:
        raise PushMalformed(f"the push header is not JSON: {exc}") from None
    sizes, names = header.get("blobs"), header.get("files")
    if not isinstance(header, dict) or not isinstance(sizes, list) or not isinstance(names, dict):
        raise PushMalformed("the push header lacks its 'blobs' and 'files' lengths")
    lengths = [*sizes, *names.values()]
    if not all(type(n) is int and n >= 0 for n in lengths) or start + hlen + sum(lengths) != len(view):
        raise PushMalformed("the blob and file lengths do not add up to the body")
    pos, parts = start + hlen, []
    for n in lengths:
        parts.append(bytes(view[pos : pos + n]))
        pos += n
    return header, parts[: len(sizes)], dict(zip(names, parts[len(sizes):], strict=True))


def manifest_check(manifest_text: str, expected_hash: str) -> dict[str, Any]:
    """The pushed manifest, if it is the one the registry names (its SHA-256 is the version's
    manifest hash); CheckpointCorrupt otherwise."""
    data = manifest_text.encode()
    if hashlib.sha256(data).hexdigest() != expected_hash:
        raise CheckpointCorrupt(f"the pushed manifest is not {expected_hash[:12]}, the one the registry names")
    manifest = json.loads(data)
    if not isinstance(manifest, dict) or "checkpoint_hash" not in manifest or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorrupt("the pushed manifest is not a checkpoint manifest")
    return manifest


def push_apply(
    state: Mapping[str, torch.Tensor] | None, checkpoint: str | None, blobs: list[bytes]
) -> tuple[dict[str, torch.Tensor], str]:
    """Decodes the blobs in order onto `state` (whose checkpoint hash is `checkpoint`); every
    blob's parent must be the checkpoint before it. Returns the new state and its checkpoint hash;
    CheckpointCorrupt on any mismatch, before anything is returned."""
    if not blobs:
        if state is None or checkpoint is None:
            raise CheckpointCorrupt("an empty push needs a base the replica holds")
        return dict(state), checkpoint
    current: dict[str, torch.Tensor] | None = dict(state) if state is not None else None
    known = checkpoint
    for blob in blobs:
        manifest = read_manifest(blob)
        if manifest["kind"] == "full":
            current, known = decode(blob), manifest["checkpoint_hash"]
            continue
        if current is None:
            raise CheckpointCorrupt("the push starts with a delta but the replica holds no base")
        current = decode(blob, current, parent_hash=known)
        known = manifest["checkpoint_hash"]
    assert current is not None and known is not None
    return current, known


def files_check(manifest: dict[str, Any], pushed: Mapping[str, bytes], held: Mapping[str, bytes]) -> dict[str, bytes]:
    """The version's side files (pushed, else the base's), each checked against the manifest."""
    out: dict[str, bytes] = {}
    for name, digest in manifest["files"].items():
        data = pushed.get(name, held.get(name))
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointCorrupt(f"side file {name!r} does not match the manifest (missing or altered)")
        out[name] = data
    return out


# --- the sender's side: which blobs a replica lacks -----------------------------------------------


def chain_hashes(store: Any, manifest_hash: str) -> list[tuple[str, dict[str, Any]]]:
    """(manifest hash, manifest) from the full snapshot down to `manifest_hash`."""
    out = [(manifest_hash, store.manifest(manifest_hash))]
    while out[-1][1]["kind"] == "delta":
        parent = out[-1][1]["parent"]
        out.append((parent, store.manifest(parent)))
        if len(out) > 10_000:
            raise CheckpointCorrupt("delta chain does not end in a full snapshot")
    return out[::-1]


def push_plan(store: Any, base: str | None, target: str) -> list[bytes]:
    """The fewest bytes that take a replica holding `base` to `target`: the stored deltas after
    `base` when it is an ancestor; else one delta computed between the two (a rollback, a sibling),
    or the whole chain from the snapshot, whichever is smaller."""
    chain = chain_hashes(store, target)
    hashes = [h for h, _ in chain]
    if base in hashes:
        return [store.storage.get(m["blob"]) for _, m in chain[hashes.index(base) + 1 :]]
    full = [store.storage.get(m["blob"]) for _, m in chain]
    if base is None or not store.storage.exists(base):
        return full
    base_manifest = store.manifest(base)
    direct = encode(store.load_state_dict(target), store.load_state_dict(base),
                    parent_hash=base_manifest["checkpoint_hash"])
    return [direct] if len(direct) < sum(len(b) for b in full) else full


def files_plan(store: Any, base: str | None, target: str) -> dict[str, bytes]:
    """The target's side files the base does not hold byte for byte."""
    wanted = store.manifest(target)["files"]
    held = store.manifest(base)["files"] if base else {}
    return {name: store.storage.get(key) for name, key in wanted.items() if held.get(name) != key}
