"""Lossless checkpoint codec: XOR against the parent, byte planes, zstd; verified on decode.

Per tensor, the raw bits (never the float values, so NaN payloads, +-inf, -0.0 and subnormals
survive) are XOR-ed with the parent tensor's bits and split into byte planes (2 for bf16/fp16,
4 for fp32, 1..8 for ints). Each plane is stored as one of:

- `zero`: all bytes zero (an unchanged tensor costs a few manifest bytes);
- `sparse`: a plane with < 1/4 non-zero bytes: zero-run lengths as bytes (255 escapes to a u64)
  then the non-zero bytes, one zstd frame. A 1%-changed bf16 tensor has ~1% non-zero bytes in
  its low plane; zstd alone spends ~14 bits per change finding those zero runs, run lengths
  cost ~8, which is what takes the ratio past 100x;
- `dense`: the plane bytes, one zstd frame.

A 2-byte float tensor (bf16, fp16) with a parent, 4% to half of its values changed, is coded
`ordered` instead: each value's arithmetic difference from its parent's bits (mod 2^16), the
values taken in the order of their parent's exponent (a stable sort the decoder repeats from the
parent it holds). An update at a fixed learning rate moves a small weight across a bf16 rounding
boundary far more often than a large one, so the changes bunch by exponent, and a one-ulp change is
+-1 however many bits its carry flips in an XOR. Two frames: the sorted changes' positions and low
bytes (a sparse frame), and what their high bytes add to the low byte's sign extension (almost all
zero); each exponent group of GROUP_MIN changes or more gets zstd blocks (Huffman tables) of its
own. On real bf16 RL updates of the 25M shape at lr 1e-5 (bench/delta.py): 19.6x -> 27.0x after
8 steps, 30.5x -> 41.2x after 40, where the XOR planes' order-0 bound is 23.6x after 8.

Full snapshots (no parent, or a tensor the parent lacks) rotate float words left by one bit first
so the top plane holds exactly the exponent (sign moves to the low plane); that plane carries
all the redundancy and is compressed at `FULL_LEVEL`, the others at `LEVEL`.

Sparse deltas never materialise the planes: changed elements are found by comparing 8-byte
words (one vectorised pass over parent and child) and only those elements are split.

Container: MAGIC | u64 manifest length | manifest JSON | payload | BLAKE3 of all before it.
The manifest holds dtype, shape and BLAKE3 of every reconstructed tensor, the checkpoint hash
(over names, dtypes, shapes and tensor hashes, so full and delta encodings of the same weights
share it) and the parent's checkpoint hash. `decode` checks all of them and raises
`CheckpointCorrupt` on any mismatch, truncation or wrong parent, before returning any tensor.

Why BLAKE3: the tensor hashes cover every raw byte, so their cost is per byte of weights, not
of delta; SHA-256 (even with SHA-NI) made a 1%-changed encode slower than `zstd -1` on the raw
tensor, BLAKE3's SIMD tree hashes several times faster and can use more threads (it follows
`torch.get_num_threads()` for tensors of a MiB and more). Format 1 blobs (SHA-256) still decode.

    blob = encode(child_state_dict, parent=parent_state_dict)
    state = decode(blob, parent=parent_state_dict)

Bench: `.venv/bin/python bench/delta.py`; tests: `.venv/bin/python -m pytest tests/kernels -q -p no:django`
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any

import blake3
import numpy as np
import torch
import zstandard

MAGIC = b"FWDELTA1"  # the container layout; the manifest's "format" names the hash
FORMAT = 2  # 1: SHA-256 hashes (still decoded), 2: BLAKE3
LEVEL = 1  # chosen by bench/delta.py: higher levels gain <10% on sparse planes at 1/3 the speed; see _compressor
FULL_LEVEL = 19  # exponent plane of full snapshots only: >= 17 picks its literal coder, see _compressor
SPARSE_MAX = 0.25  # a plane with fewer non-zero bytes than this fraction is coded sparse
# A 2-byte float delta with a share of changed values in [ORDERED_MIN, ORDERED_MAX) is coded ordered.
# Below ORDERED_MIN the XOR planes touch only the changed words (the encode of a 1% update runs as
# fast as `zstd -1` on the raw tensor; sorting every value by exponent costs 4x that) and code
# within 6% of ordered (bench/delta.py's synthetic 1% and 3%). From 4% ordered codes 9-10% smaller
# on i.i.d. one-ulp changes and 35-70% on real RL steps, at 110-200 MB/s against the XOR planes' 500+.
ORDERED_MIN = 0.04
ORDERED_MAX = 0.5
GROUP_MIN = 4_096  # changes in an exponent group worth blocks (Huffman tables) of their own
_EXPONENT = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F)}  # (shift, mask) of the exponent field
_DIGEST = 32  # both hashes give 32 bytes
_THREADED_BYTES = 1 << 20  # below this, starting hash threads costs more than it saves
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2,
)}  # fmt: skip
_FLOATS = {"float64", "float32", "float16", "bfloat16"}


class CheckpointCorrupt(ValueError):
    """The blob or chain does not reproduce the hashes it promises; nothing should be loaded."""


# --- raw bits -----------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-int numpy view of a tensor's raw bits (copy only if not contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().view(_UINT[t.element_size()])


def _tensor(bits: np.ndarray, dtype_name: str, shape: list[int]) -> torch.Tensor:
    dtype = _DTYPES[dtype_name]
    return torch.from_numpy(bits.view(np.uint8)).view(dtype).reshape(shape)


def _blake3(data: Any) -> Any:
    threads = torch.get_num_threads() if memoryview(data).nbytes >= _THREADED_BYTES else 1
    return blake3.blake3(data, max_threads=threads)


# format -> hash constructor (hexdigest()/digest() objects); a blob is verified with its own.
_HASHES: dict[int, Callable[[Any], Any]] = {1: hashlib.sha256, 2: _blake3}


def tensor_hash(t: torch.Tensor, fmt: int = FORMAT) -> str:
    return _HASHES[fmt](_bits(t).view(np.uint8).data).hexdigest()


def _checkpoint_digest(entries: list[tuple[str, str, list[int], str]], fmt: int = FORMAT) -> str:
    canon = json.dumps(sorted(entries), separators=(",", ":")).encode()
    return _HASHES[fmt](canon).hexdigest()


def checkpoint_hash(tensors: Mapping[str, torch.Tensor], fmt: int = FORMAT) -> str:
    """Hash of a whole state dict: names, dtypes, shapes and tensor bytes."""
    entries = [(k, _dtype_name(t), list(t.shape), tensor_hash(t, fmt)) for k, t in tensors.items()]
    return _checkpoint_digest(entries, fmt)


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"dtype {t.dtype} is not supported by the delta codec")
    return name


def _rotl1(x: np.ndarray) -> np.ndarray:
    bits = x.dtype.itemsize * 8
    return (x << x.dtype.type(1)) | (x >> x.dtype.type(bits - 1))


def _rotr1(x: np.ndarray) -> np.ndarray:
    bits = x.dtype.itemsize * 8
    return (x >> x.dtype.type(1)) | (x << x.dtype.type(bits - 1))


# --- planes ---------------------------------------------------------------------------------


_LOCAL = threading.local()  # a ZstdCompressor is not safe to share between threads


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level` (made once per thread; see _new_compressor)."""
    made = _LOCAL.__dict__.setdefault("compressors", {})
    if level not in made:
        made[level] = _new_compressor(level)
    return made[level]


def _new_compressor(level: int) -> zstandard.ZstdCompressor:
    """zstd for a plane or a sparse frame. Our planes are near-i.i.d. bytes (an exponent plane, XOR
    deltas, run lengths) whose gain is all in the literals' Huffman coding: a short match costs
    more than the literals it replaces. So `LEVEL` (1) and `FULL_LEVEL` (>= 17) both take the
    fast strategy with a 64-entry hash and min_match 7 (it finds the long runs, zero rows and
    repeats, and leaves the rest literal) in 128 KiB blocks (window_log 17: smaller blocks pay a
    Huffman table each). Measured (bench/delta.py; /tmp scripts on 10-20M values):
    - exponent plane of N(0, 0.02) bf16: 3.070x at 384 MB/s; level 19's optimal parser 3.075x
      at 11 MB/s, level 1 2.78x;
    - a bf16 delta with 6% of values one ulp away: 34.3x at 182 MB/s; level 1 32.7x at 112 MB/s;
    - arange, repeated rows, fp32 dense deltas: within 1% of level 1 either way.
    Other levels (the bench's sweep) are zstd's own."""
    if level <= 1 or level >= 17:
        params = zstandard.ZstdCompressionParameters(window_log=17, chain_log=6, hash_log=6, search_log=1,
                                                     min_match=7, target_length=0,
                                                     strategy=zstandard.STRATEGY_FAST)
        return zstandard.ZstdCompressor(compression_params=params)
    return zstandard.ZstdCompressor(level=level)


def _sparse_frame(pos: np.ndarray, vals: np.ndarray, level: int,
                  cuts: list[int] | None = None) -> tuple[bytes, dict[str, int]]:
    """Sorted positions (k,) + non-zero bytes (k,) -> zstd(run bytes | long runs u64 | bytes).
    `cuts`: indices into the k changes where their statistics change (the ordered delta's exponent
    groups): a block ends there, in the runs and in the bytes, so each part gets a Huffman table
    of its own. The frame decodes the same either way."""
    runs = np.diff(pos, prepend=-1) - 1  # (k,) zero bytes before each non-zero one
    long_runs = runs[runs >= 255].astype("<u8")
    short = np.minimum(runs, 255).astype(np.uint8)
    vals = vals.astype(np.uint8)
    bounds = [0, *(cuts or []), int(pos.size)]
    # One frame, but a block ends after the runs, so the bytes get a Huffman table of their own
    # (a run length and a changed byte are two distributions): 30.7x -> 33.8x on a 1M-value
    # bf16 delta with 6% of values one ulp away, 125.7x -> 139.7x at 1%.
    stream = _compressor(level).compressobj(size=int(short.size + 8 * long_runs.size + vals.size))
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        parts += [stream.compress(short[a:b].tobytes()), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
    parts += [stream.compress(long_runs.tobytes()), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        parts += [stream.compress(vals[a:b].tobytes())]
        parts += [stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK if b < bounds[-1] else zstandard.COMPRESSOBJ_FLUSH_FINISH)]
    return b"".join(parts), {"nnz": int(pos.size), "long": int(long_runs.size)}


def _encode_plane(plane: np.ndarray, level: int) -> tuple[bytes, dict[str, Any]]:
    nnz = int(np.count_nonzero(plane))
    if nnz == 0:
        return b"", {"codec": "zero"}
    if nnz < SPARSE_MAX * plane.size:
        pos = np.flatnonzero(plane)
        data, meta = _sparse_frame(pos, plane[pos], level)
        return data, {"codec": "sparse", **meta}
    return _compressor(level).compress(plane.data), {"codec": "dense"}


def _planes(x: np.ndarray) -> list[np.ndarray]:
    """(n,) uint words -> itemsize contiguous (n,) byte planes, least significant first."""
    u8 = x.view(np.uint8).reshape(-1, x.dtype.itemsize)  # (n, w)
    return [np.ascontiguousarray(u8[:, p]) for p in range(x.dtype.itemsize)]


def _changed(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (k,) where a != b and their XOR (k,), comparing 8-byte words in one pass."""
    per = 8 // a.dtype.itemsize
    whole = a.size - a.size % per
    words = np.flatnonzero(a[:whole].view(np.uint64) != b[:whole].view(np.uint64))  # (m,)
    cand = (words[:, None] * per + np.arange(per)).reshape(-1)  # (m * per,)
    cand = np.concatenate([cand, np.arange(whole, a.size)])
    x = a[cand] ^ b[cand]
    keep = x != 0
    return cand[keep], x[keep]


def _encode_sparse_delta(idx: np.ndarray, x: np.ndarray, level: int) -> tuple[list[bytes], list[dict[str, Any]]]:
    datas, metas = [], []
    for p in range(x.dtype.itemsize):
        v = (x >> x.dtype.type(8 * p)).astype(np.uint8)  # (k,) byte p of each change
        nz = v != 0
        if not nz.any():
            datas.append(b"")
            metas.append({"codec": "zero"})
            continue
        data, meta = _sparse_frame(idx[nz], v[nz], level)
        datas.append(data)
        metas.append({"codec": "sparse", **meta})
    return datas, metas


def _exponent_key(parent: np.ndarray, dtype_name: str) -> np.ndarray:
    """(n,) uint8 exponent field of each value of a 2-byte float tensor's bits."""
    shift, mask = _EXPONENT[dtype_name]
    return ((parent >> np.uint16(shift)) & np.uint16(mask)).astype(np.uint8)


def _exponent_order(key: np.ndarray) -> np.ndarray:
    """(n,) indices of the values, stably sorted by their exponent field (the decoder repeats it)."""
    return np.argsort(key, kind="stable")


def _encode_ordered_delta(
    child: np.ndarray, parent: np.ndarray, dtype_name: str, level: int
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """The `ordered` frames of a 2-byte float delta."""
    diff = child - parent  # (n,) uint16, mod 2^16
    key = _exponent_key(parent, dtype_name)
    d = diff[_exponent_order(key)]  # (n,)
    pos = np.flatnonzero(d)  # (k,)
    v = d[pos]  # (k,)
    low = (v & np.uint16(0xFF)).astype(np.uint8)
    high = ((v - low.view(np.int8).astype(np.uint16)) >> np.uint16(8)).astype(np.uint8)  # 0 for |v| < 128
    # Each exponent group of at least GROUP_MIN changes gets blocks of its own (smaller ones are
    # merged with the next: a Huffman table costs more than they would gain).
    group_ends = np.searchsorted(pos, np.cumsum(np.bincount(key, minlength=256)))  # (256,) change index
    cuts, last = [], 0
    for end in group_ends.tolist():
        if end - last >= GROUP_MIN and end < pos.size:
            cuts.append(end)
            last = end
    frame, meta = _sparse_frame(pos, low, level, cuts)
    high_data, high_meta = _encode_plane(high, level)
    return [frame, high_data], [{"codec": "ordered", **meta}, {"codec": "ordered-high", "plane": high_meta}]


def _encode_tensor(
    child: np.ndarray, parent: np.ndarray | None, dtype_name: str, level: int, full_level: int
) -> tuple[list[bytes], list[dict[str, Any]], bool]:
    """Returns plane payloads, plane metadata, whether the words were rotated (full mode)."""
    is_float = dtype_name in _FLOATS
    if parent is not None:
        idx, x = _changed(child, parent)
        if dtype_name in _EXPONENT and ORDERED_MIN * child.size <= idx.size < ORDERED_MAX * child.size:
            datas, metas = _encode_ordered_delta(child, parent, dtype_name, level)
            return datas, metas, False
        if idx.size < SPARSE_MAX * child.size:
            datas, metas = _encode_sparse_delta(idx, x, level)
            return datas, metas, False
        coded = [_encode_plane(p, level) for p in _planes(child ^ parent)]
        return [c[0] for c in coded], [c[1] for c in coded], False
    rotate = is_float and child.dtype.itemsize > 1
    planes = _planes(_rotl1(child) if rotate else child)
    top = len(planes) - 1
    coded = [_encode_plane(p, full_level if rotate and i == top else level) for i, p in enumerate(planes)]
    return [c[0] for c in coded], [c[1] for c in coded], rotate


# --- container ------------------------------------------------------------------------------


def encode(
    tensors: Mapping[str, torch.Tensor],
    parent: Mapping[str, torch.Tensor] | None = None,
    *,
    level: int = LEVEL,
    full_level: int = FULL_LEVEL,
    parent_hash: str | None = None,
) -> bytes:
    """Encode a state dict, as a delta against `parent` when given, else as a full snapshot.

    parent_hash may be passed when the caller already knows the parent's checkpoint hash.
    """
    payload: list[bytes] = []
    offset = 0
    entries = []
    for name, t in tensors.items():
        dtype = _dtype_name(t)
        child = _bits(t)
        p = parent.get(name) if parent is not None else None
        base = _bits(p) if p is not None and p.dtype == t.dtype and p.shape == t.shape else None
        datas, metas, rotated = _encode_tensor(child, base, dtype, level, full_level)
        for data, meta in zip(datas, metas, strict=True):
            meta.update(offset=offset, length=len(data))
            offset += len(data)
            payload.append(data)
        digest = _blake3(child.view(np.uint8).data).hexdigest()
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "hash": digest,
                        "mode": "delta" if base is not None else "full", "rotated": rotated, "planes": metas})  # fmt: skip
    body = b"".join(payload)
    manifest = {
        "format": FORMAT,
        "kind": "delta" if parent is not None else "full",
        "parent_hash": (parent_hash or checkpoint_hash(parent)) if parent is not None else None,
        "checkpoint_hash": _checkpoint_digest([(e["name"], e["dtype"], e["shape"], e["hash"]) for e in entries]),
        "payload_bytes": len(body),
        "tensors": entries,
    }
    mjson = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    head = MAGIC + struct.pack("<Q", len(mjson)) + mjson
    digest = _blake3(head)
    digest.update(body)
    return head + body + digest.digest()


def _split(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    """Verify the container digest, return (manifest, payload view)."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + 8 + _DIGEST or bytes(view[: len(MAGIC)]) != MAGIC:
        raise CheckpointCorrupt("not a Flywheel delta blob (bad magic or truncated header)")
    (mlen,) = struct.unpack_from("<Q", view, len(MAGIC))
    start = len(MAGIC) + 8
    if mlen > len(view) - start - _DIGEST:
        raise CheckpointCorrupt("manifest length runs past the blob (truncated or altered)")
    try:
        manifest = json.loads(bytes(view[start : start + mlen]))
    except ValueError as e:
        raise CheckpointCorrupt(f"manifest is not valid JSON (truncated or altered): {e}") from e
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    # The format picks the hash; a flipped format byte then fails the digest below.
    if type(fmt) is not int or fmt not in _HASHES:
        raise CheckpointCorrupt(f"unknown blob format {fmt!r} (altered, or written by a newer Flywheel)")
    if _HASHES[fmt](view[:-_DIGEST]).digest() != bytes(view[-_DIGEST:]):
        raise CheckpointCorrupt("blob checksum mismatch: the blob was truncated or altered")
    payload = view[start + mlen : -_DIGEST]
    if manifest.get("payload_bytes") != len(payload):
        raise CheckpointCorrupt("manifest payload length does not match the blob")
    return _current_keys(manifest), payload


def _current_keys(manifest: dict[str, Any]) -> dict[str, Any]:
    """Format 1 named its SHA-256 hashes after the function; later formats say `hash`."""
    if manifest["format"] != 1:
        return manifest
    out = {k: v for k, v in manifest.items() if k not in ("checkpoint_sha256", "parent_sha256")}
    out.update(checkpoint_hash=manifest["checkpoint_sha256"], parent_hash=manifest["parent_sha256"])
    out["tensors"] = [{**{k: v for k, v in e.items() if k != "sha256"}, "hash": e["sha256"]} for e in manifest["tensors"]]
    return out


def read_manifest(blob: bytes) -> dict[str, Any]:
    """The verified manifest of a blob (raises CheckpointCorrupt like decode)."""
    return _split(blob)[0]


def _unzstd(data: memoryview, size: int) -> np.ndarray:
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=size)
    except zstandard.ZstdError as e:
        raise CheckpointCorrupt(f"zstd frame does not decode: {e}") from e
    if len(raw) != size:
        raise CheckpointCorrupt(f"plane decoded to {len(raw)} bytes, expected {size}")
    return np.frombuffer(raw, dtype=np.uint8)


def _sparse_decode(data: memoryview, meta: dict[str, Any], n: int) -> tuple[np.ndarray, np.ndarray]:
    k, n_long = int(meta["nnz"]), int(meta["long"])
    raw = _unzstd(data, 2 * k + 8 * n_long)
    runs = raw[:k].astype(np.int64)  # (k,)
    long_runs = raw[k : k + 8 * n_long].view("<u8").astype(np.int64)
    if int(np.count_nonzero(raw[:k] == 255)) != n_long:
        raise CheckpointCorrupt("sparse plane escape count does not match the manifest")
    runs[raw[:k] == 255] = long_runs
    pos = np.cumsum(runs + 1) - 1  # (k,)
    if k and (pos[-1] >= n or runs.min() < 0):
        raise CheckpointCorrupt("sparse plane positions run past the tensor")
    return pos, raw[k + 8 * n_long :]


def _plane_bytes(data: memoryview, meta: dict[str, Any], n: int) -> np.ndarray:
    """(n,) bytes of a plane coded by `_encode_plane`."""
    if meta["codec"] == "zero":
        return np.zeros(n, dtype=np.uint8)
    if meta["codec"] == "dense":
        return _unzstd(data, n)
    if meta["codec"] == "sparse":
        pos, vals = _sparse_decode(data, meta, n)
        out = np.zeros(n, dtype=np.uint8)
        out[pos] = vals
        return out
    raise CheckpointCorrupt(f"unknown plane codec {meta['codec']!r}")


def _decode_ordered(payload: memoryview, entry: dict[str, Any], base: np.ndarray, n: int) -> np.ndarray:
    """A 2-byte float delta coded `ordered` (see `_encode_ordered_delta`), added onto base."""
    planes = entry["planes"]
    if (entry["dtype"] not in _EXPONENT or len(planes) != 2 or planes[1].get("codec") != "ordered-high"
            or not isinstance(planes[1].get("plane"), dict)):
        raise CheckpointCorrupt(f"{entry['name']}: an ordered delta needs a 2-byte float and two frames")
    frames = [payload[m["offset"] : m["offset"] + m["length"]] for m in planes]
    pos, low = _sparse_decode(frames[0], planes[0], n)  # (k,), positions in exponent order
    high = _plane_bytes(frames[1], planes[1]["plane"], pos.size)
    v = low.view(np.int8).astype(np.uint16) + (high.astype(np.uint16) << np.uint16(8))  # mod 2^16
    words = base.copy()
    words[_exponent_order(_exponent_key(base, entry["dtype"]))[pos]] += v
    return words


def _decode_words(payload: memoryview, entry: dict[str, Any], base: np.ndarray | None) -> np.ndarray:
    """Rebuild a tensor's unsigned words from its planes (XOR-ed onto base for deltas)."""
    width = _DTYPES[entry["dtype"]].itemsize
    n = int(np.prod(entry["shape"], dtype=np.int64))
    if entry["planes"] and entry["planes"][0].get("codec") == "ordered":
        if base is None:
            raise CheckpointCorrupt(f"{entry['name']}: an ordered delta without its parent tensor")
        return _decode_ordered(payload, entry, base, n)
    words = base.copy() if base is not None else np.zeros(n, dtype=_UINT[width])
    if len(entry["planes"]) != width:
        raise CheckpointCorrupt(f"{entry['name']}: {len(entry['planes'])} planes for a {width}-byte dtype")
    for p, meta in enumerate(entry["planes"]):
        data = payload[meta["offset"] : meta["offset"] + meta["length"]]
        shift = words.dtype.type(8 * p)
        if meta["codec"] == "sparse":
            pos, vals = _sparse_decode(data, meta, n)
            words[pos] ^= vals.astype(words.dtype) << shift
        elif meta["codec"] == "dense":
            words ^= _unzstd(data, n).astype(words.dtype) << shift
        elif meta["codec"] != "zero":
            raise CheckpointCorrupt(f"{entry['name']}: unknown plane codec {meta['codec']!r}")
    return _rotr1(words) if entry["rotated"] else words


def decode(
    blob: bytes, parent: Mapping[str, torch.Tensor] | None = None, *, parent_hash: str | None = None
) -> dict[str, torch.Tensor]:
    """Rebuild the state dict; raises CheckpointCorrupt unless every hash matches.

    parent_hash: the parent's checkpoint hash if the caller has already verified it (skips
    rehashing the parent).
    """
    manifest, payload = _split(blob)
    fmt = manifest["format"]
    _check_parent(manifest, parent, parent_hash)
    out: dict[str, torch.Tensor] = {}
    for entry in manifest["tensors"]:
        base = _bits(parent[entry["name"]]) if entry["mode"] == "delta" and parent is not None else None
        if entry["mode"] == "delta" and base is None:
            raise CheckpointCorrupt(f"{entry['name']}: delta entry but the parent lacks the tensor")
        words = _decode_words(payload, entry, base)
        if _HASHES[fmt](words.view(np.uint8).data).hexdigest() != entry["hash"]:
            raise CheckpointCorrupt(f"{entry['name']}: reconstructed tensor does not match its hash")
        out[entry["name"]] = _tensor(words, entry["dtype"], entry["shape"])
    digest = _checkpoint_digest([(e["name"], e["dtype"], e["shape"], e["hash"]) for e in manifest["tensors"]], fmt)
    if digest != manifest["checkpoint_hash"]:
        raise CheckpointCorrupt("checkpoint hash does not match the tensors in the manifest")
    return out


def _check_parent(manifest: dict[str, Any], parent: Mapping[str, torch.Tensor] | None, known: str | None) -> None:
    if manifest["kind"] == "full":
        return
    if parent is None:
        raise CheckpointCorrupt("this blob is a delta: pass the parent state dict to decode it")
    # Hashed with the blob's own format: a parent hash known from a format-1 chain is passed in.
    actual = known or checkpoint_hash(parent, manifest["format"])
    if actual != manifest["parent_hash"]:
        raise CheckpointCorrupt(f"wrong parent: blob expects {manifest['parent_hash'][:12]}, got {actual[:12]}")
