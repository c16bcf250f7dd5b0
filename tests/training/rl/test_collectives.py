"""FSDP2's all-gather and reduce-scatter as rings of paired sends (training/rl/collectives.py)
against gloo's own, on 2 and 3 CPU processes.

    .venv/bin/python -m pytest tests/training/rl/test_collectives.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.rl.collectives import ring_all_gather, ring_reduce_scatter

# whole sizes per rank count: a part of one value, odd parts, and parts of a few hundred thousand
SIZES = (1, 7, 300_001)
DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def _compare(rank: int, size: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    group = dist.group.WORLD
    found: list[dict] = []
    for part in SIZES:
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(1000 * rank + part)
            mine = (torch.randn(part, generator=gen) * 100).to(dtype)
            whole = (torch.randn(part * size, generator=gen) * 100).to(dtype)
            theirs, ours = torch.empty(part * size, dtype=dtype), torch.empty(part * size, dtype=dtype)
            dist.all_gather_single(theirs, mine)
            ring_all_gather(ours, mine, group)
            row = {"part": part, "dtype": str(dtype), "gather_equal": torch.equal(theirs, ours)}
            if dtype != torch.uint8:
                theirs, ours = torch.empty(part, dtype=dtype), torch.empty(part, dtype=dtype)
                dist.reduce_scatter_single(output=theirs, input=whole)
                ring_reduce_scatter(ours, whole, group)
                exact = sum(p.double() for p in _every_ranks(whole, size, part, dtype)).to(dtype)
                row |= {"scatter_equal": torch.equal(theirs, ours),
                        "scatter_err": float((ours.double() - exact.double()).abs().max()),
                        "ulp": float(torch.finfo(dtype).eps * exact.double().abs().max().clamp(min=1))}
            found.append(row)
    try:
        ring_all_gather(torch.empty(part * size + 1), torch.empty(part), group)
    except ValueError as e:
        found.append({"refused": str(e)})
    Path(out, f"rank-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _every_ranks(whole: torch.Tensor, size: int, part: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's share of this rank's part, regenerated from the ranks' seeds."""
    rank = dist.get_rank()
    shares = []
    for other in range(size):
        gen = torch.Generator().manual_seed(1000 * other + part)
        torch.randn(part, generator=gen)
        theirs = (torch.randn(part * size, generator=gen) * 100).to(dtype)
        shares.append(theirs.chunk(size)[rank])
    return shares


@pytest.mark.parametrize("size", [2, 3])
def test_the_rings_gather_and_reduce_as_gloo_does(tmp_path, size):
    mp.start_processes(_compare, args=(size, str(tmp_path / "store"), str(tmp_path)), nprocs=size,
                       start_method="spawn")
    for rank in range(size):
        rows = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert "needs the whole" in rows.pop()["refused"]  # a whole that is not `size` parts is refused
        assert len(rows) == len(SIZES) * len(DTYPES)
        for row in rows:
            assert row["gather_equal"], row  # a gather copies bits
            if "scatter_equal" in row:
                if size == 2:  # two addends: the same sum in either order
                    assert row["scatter_equal"], row
                # any order of 3 additions is within 2 roundings of the exact sum
                assert row["scatter_err"] <= 2 * row["ulp"], row
