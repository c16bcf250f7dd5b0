"""FSDP2's all-gather and reduce-scatter over gloo as rings of point-to-point exchanges.

Gloo's own `all_gather_single` and `reduce_scatter_single` stage every rank's part through buffers
of their own: on 2 CPU ranks (25M fp32 values, 100 MB) they took 125 and 115 ms, where its
`all_reduce` of the same 100 MB, which moves as many bytes per rank as the two together, took 73.
A ring of paired sends and receives moves each part once, straight into the output:

    values 25M, 2 ranks, 1 thread each     gloo    ring
    all-gather                           125 ms   46 ms
    reduce-scatter                       115 ms   34 ms

FSDP2 calls them through `set_custom_all_gather` / `set_custom_reduce_scatter` (`install`) for each
sharded block's all-gathers (forward and backward) and reduce-scatter; NCCL keeps its own
collectives: only a gloo group gets them. Either way on gloo (`ring=False`: gloo's own) their
seconds are counted on a `CommClock`, which each rank's record of a job reports per step.

The results are the same as gloo's: the all-gather copies bits; on 2 ranks the reduce-scatter adds
the same two values (floating-point addition commutes), on more the ring adds in ring order (the
float rounding of any other order).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's (torch 2.13)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sends `send` to the next rank of the ring and receives `recv` from the previous one."""
    rank, size = group.rank(), group.size()
    after = dist.get_global_rank(group, (rank + 1) % size)
    before = dist.get_global_rank(group, (rank - 1) % size)
    ops = [dist.P2POp(dist.isend, send, after, group), dist.P2POp(dist.irecv, recv, before, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _check_sizes(whole: torch.Tensor, part: torch.Tensor, size: int) -> None:
    if whole.numel() != size * part.numel() or whole.dtype != part.dtype:
        raise ValueError(f"a ring over {size} ranks needs the whole ({whole.numel()} {whole.dtype}) to be "
                         f"{size} parts ({part.numel()} {part.dtype}) of one dtype")


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`output` (size x input's numel) gets every rank's `input`, rank by rank."""
    rank, size = group.rank(), group.size()
    _check_sizes(output, input, size)
    parts = output.view(-1).chunk(size)
    mine = parts[rank]
    if input.data_ptr() != mine.data_ptr():  # FSDP2 copies its input into its slot of the output
        mine.copy_(input.view(-1))
    for step in range(size - 1):  # step s passes on the part received at step s - 1
        _exchange(parts[(rank - step) % size], parts[(rank - step - 1) % size], group)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`output` gets the sum over ranks of their `input`'s part `rank` (input: size x output's numel)."""
    rank, size = group.rank(), group.size()
    _check_sizes(input, output, size)
    parts = input.view(-1).chunk(size)
    out = output.view(-1)
    # Step s receives the running sum of part (rank - s - 2) from the previous rank, adds this rank's
    # share and passes it on; the last step's part is this rank's own, received straight into `out`.
    sending = parts[(rank - 1) % size]
    spare: list[torch.Tensor] = []
    for step in range(size - 2):
        if len(spare) < 2:
            spare.append(torch.empty_like(out))
        received = spare[step % 2]  # never the one being sent
        _exchange(sending, received, group)
        received.add_(parts[(rank - step - 2) % size])
        sending = received
    _exchange(sending, out, group)
    out.add_(parts[rank])


class CommClock:
    """Seconds a rank spent in the sharded model's all-gathers and reduce-scatters (waiting for its
    peers included)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, start: float) -> None:
        self.seconds += time.perf_counter() - start


class _Timed(DefaultAllocMixin):
    """A collective FSDP2 calls, the ring's or gloo's own, timed on `clock`; its buffers are
    FSDP2's default (`torch.empty`)."""

    def __init__(self, ring: bool, clock: CommClock) -> None:
        self.ring, self.clock = ring, clock


class _AllGather(_Timed, AllGather):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        start = time.perf_counter()
        if self.ring:
            ring_all_gather(output_tensor, input_tensor, group)
        else:
            dist.all_gather_single(output_tensor, input_tensor, group=group)
        self.clock.add(start)  # done on return: FSDP2 then waits on nothing


class _ReduceScatter(_Timed, ReduceScatter):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        start = time.perf_counter()
        if self.ring and op == dist.ReduceOp.SUM:  # `shard` asks for sums; any other reduction is gloo's
            ring_reduce_scatter(output_tensor, input_tensor, group)
        else:
            dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op)
        self.clock.add(start)


def install(model: nn.Module, ring: bool = True, clock: CommClock | None = None) -> CommClock | None:
    """On a gloo group, gives every FSDP2 module of `model` these all-gathers and reduce-scatters:
    the rings, or with `ring=False` gloo's own, timed on `clock` either way (returned; a new one
    where none is given). Leaves another backend's (NCCL's) alone and returns None."""
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() != "gloo":
        return None
    clock = clock or CommClock()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_AllGather(ring, clock))
            module.set_custom_reduce_scatter(_ReduceScatter(ring, clock))
    return clock
