"""Property tests of the delta codec: bit-exact round trips, tiny deltas, detected corruption.

Run: `.venv/bin/python -m pytest tests/kernels/test_delta_codec.py -q -p no:django`
"""

from __future__ import annotations

import hashlib
import json
import struct

import blake3
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.delta import MAGIC, CheckpointCorrupt, checkpoint_hash, decode, encode, read_manifest

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]  # fmt: skip
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-45, 5e-324, 1.0]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _bits(a[k]) == _bits(b[k]) for k in a
    )


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Any bit pattern (NaN payloads, subnormals, -0.0...) of a random dtype and shape."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
    n = int(np.prod(shape, dtype=np.int64))
    size = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if n else torch.empty(0, dtype=dtype)
    if dtype == torch.bool:
        t = t.view(torch.uint8).bool()  # bool tensors hold only 0/1 bytes
    return t.reshape(shape)


def _mutate(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    out = t.clone()
    flat = out.reshape(-1).view(torch.uint8)
    if t.dtype == torch.bool or flat.numel() == 0:
        return ~out if t.dtype == torch.bool else out
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
    flat[idx] ^= 1
    return out


@FAST
@given(st.dictionaries(st.sampled_from("abcdef"), tensors(), min_size=1, max_size=4))
def test_a_full_snapshot_round_trips_bit_exactly(state: dict[str, torch.Tensor]) -> None:
    assert _same(decode(encode(state)), state)


@FAST
@given(st.dictionaries(st.sampled_from("abcd"), tensors(), min_size=1, max_size=4),
       st.floats(0.0, 1.0), st.integers(0, 2**16))  # fmt: skip
def test_a_delta_round_trips_bit_exactly(parent: dict[str, torch.Tensor], frac: float, seed: int) -> None:
    child = {k: _mutate(v, frac, seed) for k, v in parent.items()}
    child["new"] = torch.arange(5)  # a tensor the parent lacks is stored in full
    blob = encode(child, parent)
    assert _same(decode(blob, parent), child)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_special_values_survive_full_and_delta(dtype: torch.dtype) -> None:
    base = torch.tensor(SPECIALS, dtype=torch.float64).to(dtype)
    words = base.clone()
    raw = words.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()])
    raw[0] = raw[0] | 0x5  # NaN payload bits
    state = {"w": words}
    assert _same(decode(encode(state)), state)
    child = {"w": torch.flip(words, [0])}
    assert _same(decode(encode(child, state), state), child)


@FAST
@given(st.dictionaries(st.sampled_from("abc"), tensors(torch.bfloat16), min_size=1, max_size=3))
def test_an_identical_parent_gives_a_tiny_delta(state: dict[str, torch.Tensor]) -> None:
    blob = encode(state, state)
    manifest = read_manifest(blob)
    assert manifest["payload_bytes"] == 0
    assert all(p["codec"] == "zero" for e in manifest["tensors"] for p in e["planes"])
    assert len(blob) < 400 + 400 * len(state)


def test_a_one_percent_bf16_update_compresses_past_100x() -> None:
    torch.manual_seed(0)
    parent = {"w": (torch.randn(1_000_000) * 0.02).to(torch.bfloat16)}
    child = {"w": _mutate(parent["w"], 0.005, 1)}  # 1% of bf16 elements = 0.5% of bytes
    changed = (_bits(child["w"]) != _bits(parent["w"]))
    blob = encode(child, parent)
    assert changed and 2_000_000 / len(blob) > 100
    # under 4% changed: the XOR planes, which touch only the changed words (encodes as fast as zstd -1)
    assert read_manifest(blob)["tensors"][0]["planes"][0]["codec"] == "sparse"


@pytest.fixture(scope="module")
def pair() -> tuple[dict[str, torch.Tensor], bytes]:
    torch.manual_seed(1)
    parent = {"a": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(100), "c": torch.arange(7)}
    child = {k: _mutate(v, 0.05, 3) for k, v in parent.items()}
    return parent, encode(child, parent)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_flipped_byte_anywhere_is_detected(pair: tuple[dict[str, torch.Tensor], bytes], data: st.DataObject) -> None:
    parent, blob = pair
    i = data.draw(st.integers(0, len(blob) - 1))
    bad = bytearray(blob)
    bad[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CheckpointCorrupt):
        decode(bytes(bad), parent)


def _resealed(blob: bytes, i: int) -> bytes:
    """Flip byte i and recompute the container digest: only the inner hashes can catch it."""
    bad = bytearray(blob[:-32])
    bad[i] ^= 0x10
    return bytes(bad) + blake3.blake3(bad).digest()


def test_inner_hashes_never_let_a_resealed_flip_through_as_different_weights(
    pair: tuple[dict[str, torch.Tensor], bytes],
) -> None:
    parent, blob = pair
    expected = decode(blob, parent)
    payload_start = len(blob) - 32 - read_manifest(blob)["payload_bytes"]
    caught = 0
    for i in range(payload_start, len(blob) - 32):
        try:
            out = decode(_resealed(blob, i), parent)
        except CheckpointCorrupt:
            caught += 1
            continue
        # zstd ignores a reserved frame-header bit: such a flip must decode to the same bits.
        assert _same(out, expected), f"flip at payload byte {i - payload_start} changed the weights"
    assert caught > 0.9 * (len(blob) - 32 - payload_start)


def test_truncation_a_wrong_parent_and_a_missing_parent_are_refused(
    pair: tuple[dict[str, torch.Tensor], bytes],
) -> None:
    parent, blob = pair
    for cut in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CheckpointCorrupt):
            decode(blob[:cut], parent)
    other = {k: _mutate(v, 0.01, 9) for k, v in parent.items()}
    with pytest.raises(CheckpointCorrupt, match="wrong parent"):
        decode(blob, other)
    with pytest.raises(CheckpointCorrupt, match="pass the parent"):
        decode(blob)


def test_the_checkpoint_hash_ignores_the_encoding(pair: tuple[dict[str, torch.Tensor], bytes]) -> None:
    parent, blob = pair
    child = decode(blob, parent)
    assert read_manifest(blob)["checkpoint_hash"] == read_manifest(encode(child))["checkpoint_hash"]
    assert read_manifest(blob)["checkpoint_hash"] == checkpoint_hash(child)


def test_a_wrong_base_is_refused_even_when_the_caller_vouches_for_its_hash(
    pair: tuple[dict[str, torch.Tensor], bytes],
) -> None:
    """The store passes the parent hash it verified; a base that differs from it in memory (one
    element, even in a tensor the delta leaves alone) still fails the reconstructed-tensor hashes."""
    parent, blob = pair
    vouched = read_manifest(blob)["parent_hash"]
    for name in parent:
        other = dict(parent)
        other[name] = _mutate(parent[name], 0.0, 5)  # one flipped bit
        with pytest.raises(CheckpointCorrupt, match="does not match its hash"):
            decode(blob, other, parent_hash=vouched)
    unchanged = {**parent, "d": torch.ones(3)}
    blob_d = encode(unchanged, unchanged)  # every plane zero: the result is the base itself
    with pytest.raises(CheckpointCorrupt, match="does not match its hash"):
        decode(blob_d, {**unchanged, "d": torch.zeros(3)}, parent_hash=read_manifest(blob_d)["parent_hash"])


def _as_format_1(blob: bytes, state: dict[str, torch.Tensor]) -> bytes:
    """The same payload in the format-1 container: SHA-256 hashes under their old key names."""
    manifest = read_manifest(blob)
    sha = {k: hashlib.sha256(_bits(t)).hexdigest() for k, t in state.items()}
    tensors = [{**{k: v for k, v in e.items() if k != "hash"}, "sha256": sha[e["name"]]} for e in manifest["tensors"]]
    canon = json.dumps(sorted((e["name"], e["dtype"], e["shape"], e["sha256"]) for e in tensors), separators=(",", ":"))
    old = {"format": 1, "kind": manifest["kind"], "payload_bytes": manifest["payload_bytes"], "tensors": tensors,
           "checkpoint_sha256": hashlib.sha256(canon.encode()).hexdigest(), "parent_sha256": None}
    mjson = json.dumps(old, separators=(",", ":"), sort_keys=True).encode()
    body = MAGIC + struct.pack("<Q", len(mjson)) + mjson + blob[-32 - manifest["payload_bytes"] : -32]
    return body + hashlib.sha256(body).digest()


def test_a_format_1_blob_with_sha256_hashes_still_decodes_and_is_still_verified() -> None:
    state = {"w": torch.randn(300).to(torch.bfloat16), "i": torch.arange(9)}
    old = _as_format_1(encode(state), state)
    assert _same(decode(old), state)
    assert read_manifest(old)["checkpoint_hash"] == checkpoint_hash(state, fmt=1)
    bad = bytearray(old[:-32])
    bad[-1] ^= 0x01  # the last payload byte, resealed: only the SHA-256 of the tensor can tell
    with pytest.raises(CheckpointCorrupt):
        decode(bytes(bad) + hashlib.sha256(bad).digest())


def test_a_six_percent_one_ulp_bf16_update_compresses_past_32x() -> None:
    """A steady-state RL step in bf16 (fp32 masters at lr 1e-5: ~6% of values move one ulp):
    runs and changed bytes coded apart, as literals (30.7x with zstd level 1 in one block)."""
    torch.manual_seed(0)
    parent = (torch.randn(1_000_000) * 0.02).to(torch.bfloat16)
    bits = parent.view(torch.int16)
    moved = torch.rand(bits.shape) < 0.06
    step = torch.where(torch.rand(bits.shape) < 0.5, 1, -1).to(torch.int16)
    child = torch.where(moved, bits + step, bits).view(torch.bfloat16)
    blob = encode({"w": child}, {"w": parent})
    assert torch.equal(decode(blob, {"w": parent})["w"].view(torch.int16), child.view(torch.int16))
    assert 2_000_000 / len(blob) > 32, 2_000_000 / len(blob)


def test_encoding_from_several_threads_at_once_gives_each_the_blob_alone() -> None:
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(2)
    parent = {"w": (torch.randn(300_000) * 0.02).to(torch.bfloat16), "b": torch.randn(50_000)}
    children = [{k: _mutate(v, 0.01 * (i + 1), i) for k, v in parent.items()} for i in range(4)]
    alone = [encode(c, parent) for c in children] + [encode(c) for c in children]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            together = list(pool.map(lambda c: encode(c, parent), children)) + list(pool.map(encode, children))
            assert together == alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_two_byte_float_delta_is_coded_in_exponent_order_and_round_trips(dtype: torch.dtype) -> None:
    # `ordered`: each value's arithmetic difference from its parent's bits, in the order of the
    # parent's exponent. One-ulp and few-ulp moves, moves past 127 ulps (a high byte), sign
    # flips, NaN and inf, -0.0, bits wrapping past 0x7FFF, and exponent groups past GROUP_MIN.
    torch.manual_seed(3)
    parent = (torch.randn(200_000) * 0.02).to(dtype)
    bits = parent.view(torch.int16).clone()
    g = torch.Generator().manual_seed(4)
    moved = torch.rand(bits.shape, generator=g) < 0.1
    bits = torch.where(moved, bits + torch.randint(-3, 4, bits.shape, generator=g, dtype=torch.int16), bits)
    bits[:4] += torch.tensor([300, -300, 128, -129], dtype=torch.int16)
    bits[4:6] ^= torch.tensor([-32768, -32768], dtype=torch.int16)  # sign flips
    child = bits.view(dtype).clone()
    child[6:10] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    parent[10], child[10] = torch.tensor(-0.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)
    parent.view(torch.int16)[11], child.view(torch.int16)[11] = 0x7FFF, -0x8000  # wraps
    blob = encode({"w": child}, {"w": parent})
    planes = read_manifest(blob)["tensors"][0]["planes"]
    assert [p["codec"] for p in planes] == ["ordered", "ordered-high"] and planes[1]["plane"]["codec"] != "zero"
    out = decode(blob, {"w": parent})["w"]
    assert out.dtype == dtype and torch.equal(out.view(torch.int16), child.view(torch.int16))


def test_half_the_values_changed_or_more_keep_the_xor_planes() -> None:
    torch.manual_seed(5)
    parent = (torch.randn(10_000) * 0.02).to(torch.bfloat16)
    child = (parent.float() * 1.5).to(torch.bfloat16)  # every value moves
    blob = encode({"w": child}, {"w": parent})
    assert read_manifest(blob)["tensors"][0]["planes"][0]["codec"] != "ordered"
    assert torch.equal(decode(blob, {"w": parent})["w"].view(torch.int16), child.view(torch.int16))


def test_a_bf16_update_of_float32_masters_compresses_past_25x() -> None:
    """fp32 masters moved by a small step each (N(0, 4e-6): ~10% of the bf16 values change, like
    the 8th AdamW step of a real run at lr 1e-5), served in bf16: a small weight crosses a bf16
    rounding boundary far more often than a large one, which the exponent order codes apart.
    The XOR planes coded this at 19.4x."""
    torch.manual_seed(0)
    master = torch.randn(1_000_000) * 0.02
    parent = master.to(torch.bfloat16)
    child = (master + 4e-6 * torch.randn(1_000_000)).to(torch.bfloat16)
    blob = encode({"w": child}, {"w": parent})
    assert torch.equal(decode(blob, {"w": parent})["w"].view(torch.int16), child.view(torch.int16))
    assert 2_000_000 / len(blob) > 25, 2_000_000 / len(blob)
