"""FSDP2's all-gather and reduce-scatter through shared memory and as rings of paired sends
(training/rl/collectives.py) against gloo's own, on 2 and 3 CPU processes.

    .venv/bin/python -m pytest tests/training/rl/test_collectives.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.rl import collectives
from training.rl.collectives import SharedArena, ring_all_gather, ring_reduce_scatter, shared_arena

# whole sizes per rank count: a part of one value, odd parts, and parts of a few hundred thousand
SIZES = (1, 7, 300_001)
DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def _compare(rank: int, size: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    group = dist.group.WORLD
    arena = shared_arena(group)
    assert arena is not None
    found: list[dict] = []
    for part in SIZES:  # growing: the arena's buffers grow with them
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(1000 * rank + part)
            mine = (torch.randn(part, generator=gen) * 100).to(dtype)
            whole = (torch.randn(part * size, generator=gen) * 100).to(dtype)
            theirs, ours = torch.empty(part * size, dtype=dtype), torch.empty(part * size, dtype=dtype)
            shared = torch.empty(part * size, dtype=dtype)
            dist.all_gather_single(theirs, mine)
            ring_all_gather(ours, mine, group)
            assert arena.all_gather(shared, mine)
            row = {"part": part, "dtype": str(dtype), "gather_equal": torch.equal(theirs, ours),
                   "shared_gather_equal": torch.equal(theirs, shared)}
            if dtype != torch.uint8:
                theirs, ours = torch.empty(part, dtype=dtype), torch.empty(part, dtype=dtype)
                shared = torch.empty(part, dtype=dtype)
                dist.reduce_scatter_single(output=theirs, input=whole)
                ring_reduce_scatter(ours, whole, group)
                assert arena.reduce_scatter(shared, whole)
                exact = sum(p.double() for p in _every_ranks(whole, size, part, dtype)).to(dtype)
                row |= {"scatter_equal": torch.equal(theirs, ours), "shared_scatter_equal": torch.equal(theirs, shared),
                        "scatter_err": max(float((x.double() - exact.double()).abs().max()) for x in (ours, shared)),
                        "ulp": float(torch.finfo(dtype).eps * exact.double().abs().max().clamp(min=1))}
            found.append(row)
    # three turns in a row on one half each, written while the peers may still read the last turn
    for turn in range(3):
        mine = torch.full((1000,), float(10 * turn + rank))
        shared = torch.empty(1000 * size)
        assert arena.all_gather(shared, mine)
        found.append({"turn": turn, "turn_equal": torch.equal(
            shared, torch.cat([torch.full((1000,), float(10 * turn + r)) for r in range(size)]))})
    found.append({"left_in_shm": sorted(p.name for p in SharedArena.ROOT.glob(f"flywheel-fsdp-{arena.token}-*"))})
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
def test_shared_memory_and_the_rings_gather_and_reduce_as_gloo_does(tmp_path, size):
    mp.start_processes(_compare, args=(size, str(tmp_path / "store"), str(tmp_path)), nprocs=size,
                       start_method="spawn")
    for rank in range(size):
        rows = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert "needs the whole" in rows.pop()["refused"]  # a whole that is not `size` parts is refused
        assert rows.pop() == {"left_in_shm": []}  # each rank's file is unlinked once its peers mapped it
        assert all(row.pop("turn_equal") for row in rows[-3:]), rows[-3:]
        rows = rows[:-3]
        assert len(rows) == len(SIZES) * len(DTYPES)
        for row in rows:
            assert row["gather_equal"] and row["shared_gather_equal"], row  # a gather copies bits
            if "scatter_equal" in row:
                if size == 2:  # two addends: the same sum in either order
                    assert row["scatter_equal"] and row["shared_scatter_equal"], row
                # any order of 3 additions is within 2 roundings of the exact sum
                assert row["scatter_err"] <= 2 * row["ulp"], row


def _unshared(rank: int, size: int, store: str, out: str, case: str) -> None:
    """`case` "hosts": each rank's /dev/shm its own (ranks on two hosts, or in two containers);
    "full": rank 1's shared memory refuses more than 1 MB (a small /dev/shm)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    group = dist.group.WORLD
    if case == "hosts":
        SharedArena.ROOT = Path(out, f"shm-{rank}")
        SharedArena.ROOT.mkdir()
    elif rank == 1:
        allocate = collectives.os.posix_fallocate

        def small(fd: int, offset: int, length: int) -> None:
            if length > 2**20:
                raise OSError(28, "No space left on device")
            allocate(fd, offset, length)

        collectives.os.posix_fallocate = small
    arena = shared_arena(group)
    found = {"arena": arena is not None}
    if arena is not None:
        small_ok = arena.all_gather(torch.empty(2 * 1000), torch.full((1000,), float(rank)))
        big_ok = arena.all_gather(torch.empty(2 * 10**6), torch.ones(10**6))  # 4 MB: more than rank 1 has
        found |= {"small": small_ok, "big": big_ok, "closed": arena.closed,
                  "after": arena.all_gather(torch.empty(2 * 1000), torch.ones(1000))}
    # the FSDP2 hook falls back to the ring: still the right answer
    gathered = torch.empty(2 * 10**6)
    collectives._AllGather("shm", collectives.CommClock())(gathered, torch.full((10**6,), float(rank)), group)
    found["hook_equal"] = torch.equal(gathered, torch.cat([torch.zeros(10**6), torch.ones(10**6)]))
    Path(out, f"rank-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_ranks_that_cannot_share_memory_all_take_the_ring(tmp_path):
    """Every rank agrees: where one cannot map a peer's buffer (another host), no arena; where one
    cannot grow its buffer (/dev/shm too small), the arena closes on all and the ring goes on."""
    for case in ("hosts", "full"):
        folder = tmp_path / case
        folder.mkdir()
        mp.start_processes(_unshared, args=(2, str(folder / "store"), str(folder), case), nprocs=2,
                           start_method="spawn")
        rows = [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(2)]
        if case == "hosts":
            assert rows == [{"arena": False, "hook_equal": True}] * 2
        else:
            assert rows == [{"arena": True, "small": True, "big": False, "closed": True, "after": False,
                             "hook_equal": True}] * 2
