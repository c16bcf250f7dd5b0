"""Stand-in libraries that sum a matmul's K products in a set order, and the probe checks that use them.

The stand-ins do the arithmetic themselves, with elementwise fp32 ops (each exactly rounded), so
their bits are the same on every CPU and ISA: unlike `torch.mm` on K halves, whose order may be
the machine's own (MKL's sgemm on an AMD EPYC blocks K by 128, each block summed from zero, so two
K=128 calls added are bitwise its K=256 call). Imported by test_batch_invariant.py and run as
`python -m tests.kernels.reorder` by test_probe_isa.py, once per ISA setting; it must not import
the conftest (transformers takes longer to import than the checks take to run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import kernels.batch_invariant as bi

# K indices in blocks: each block is summed from zero in its order, then the block sums in order
Blocks = list[Sequence[int]]


def _halves(k: int) -> Blocks:
    return [range(k // 2), range(k // 2, k)]


# Orders a library might take instead of one accumulator over K = 0, 1, ..., K-1 (the tile's).
ORDERS: dict[str, Callable[[int], Blocks]] = {
    "k_split_in_halves": _halves,
    "k_blocks_of_32": lambda k: [range(i, min(k, i + 32)) for i in range(0, k, 32)],
    "8_lanes": lambda k: [range(j, k, 8) for j in range(8)],  # a vectorised dot product
    "tail_of_3_apart": lambda k: [range(k - 3), range(k - 3, k)],  # a scalar remainder loop
    "reversed": lambda k: [range(k - 1, -1, -1)],
}
ROUNDED_BETWEEN = {"k_halves_rounded_to_bf16": _halves}  # each half in the output dtype, then added


def ordered_mm(t: torch.Tensor, b: torch.Tensor, blocks: Blocks, block_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t (S, K) @ b (K, N) accumulated in fp32 in the given order; each block sum is rounded to
    block_dtype before it is added. The products of bf16 operands are exact in fp32."""
    prod = t.float()[:, :, None] * b.float()[None]  # (S, K, N)
    out = torch.zeros(t.shape[0], b.shape[1])  # (S, N)
    for block in blocks:
        acc = torch.zeros_like(out)
        for i in block:
            acc = acc + prod[:, i]
        out = out + acc.to(block_dtype).float()
    return out


def check_probe_rejects(order: str) -> None:
    """A stand-in library that sums K in another order whenever a call is not exactly one tile:
    the probe inputs must expose it at every other size (random rows would not, in bf16)."""
    k, n, tile = 256, 64, 16
    exact, inputs = bi._mm_probe_ops(k, n, torch.bfloat16, torch.bfloat16, torch.device("cpu"), True)
    b = exact(torch.eye(k, dtype=torch.bfloat16))  # (K, N): one exact product per output
    blocks = (ORDERS | ROUNDED_BETWEEN)[order](k)
    block_dtype = torch.bfloat16 if order in ROUNDED_BETWEEN else torch.float32

    def library(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == tile:
            return ordered_mm(t, b, [range(k)]).to(t.dtype)
        return ordered_mm(t, b, blocks, block_dtype).to(t.dtype)

    probe = bi._Probe(tile, lambda: (library, inputs), ())
    assert probe(tile)
    assert not any(probe(s) for s in (1, 5, tile - 1, 2 * tile, 8 * tile))
    # so every call is one tile, the last one padded
    assert probe.plan(3 * tile + 5) == [(0, tile, tile), (tile, tile, tile), (2 * tile, tile, tile), (3 * tile, 5, tile)]


def check_matmul_rows(tile: int = 16) -> None:
    """The guarantee on this process's real kernels: a row gets its tile call's bits in any batch."""
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((256, 64), (1024, 256)):
            g = torch.Generator().manual_seed(k + n)
            w = torch.randn(n, k, generator=g).to(dtype)  # (N, K), a linear layer's weight
            x = torch.randn(4 * tile, k, generator=g).to(dtype)  # (4 tiles, K)
            ref = torch.cat([torch.mm(x[i : i + tile], w.t()) for i in range(0, x.shape[0], tile)])  # (4 tiles, N)
            for m in (1, 2, 5, tile - 1, tile, tile + 1, 2 * tile + 3, 4 * tile):
                assert torch.equal(bi.matmul(x[:m], w.t(), tile=tile), ref[:m]), f"{dtype} K={k} N={n}: {m} rows"


def main() -> None:
    print("cpu capability:", torch.backends.cpu.get_cpu_capability(), flush=True)
    for order in (*ORDERS, *ROUNDED_BETWEEN):
        check_probe_rejects(order)
    check_matmul_rows()
    print("ok")


if __name__ == "__main__":
    main()
