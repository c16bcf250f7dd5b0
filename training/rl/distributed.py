"""The RL update past one process: torch.distributed, the policy sharded with FSDP2 (`fully_shard`).

Each rank takes an equal share of a step's rows; the loss is normalised by the whole step's
completion tokens (all ranks'), so the gradients FSDP2 reduce-scatters *sum* to the one-process
gradient, and the update equals `rl_step`'s within float rounding. Gloo on CPU, NCCL on GPU.

No database here: a job is a folder (`spec.json` + `batches.pt`, written by the caller); rank 0
writes `metrics.jsonl` and the updated policy as an HF folder (`policy/`), which the caller
registers through the checkpoint store like any run's weights. Launched by `launch()`:

    .venv/bin/torchrun --nproc-per-node 2 -m training.rl.distributed JOB_FOLDER
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.rl import collectives
from training.rl.config import RLConfig
from training.rl.nodes import Nodes
from training.rl.precision import SERVING_DTYPES, compute_context
from training.rl.trainer import METRIC_KEYS, Batch, DriftSums, StepMetrics, backward_batch

_log = logging.getLogger(__name__)
_IMPORTED = time.perf_counter()  # a rank's imports done (torch's above all): `_Stages` counts them


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class DistributedRunFailed(RuntimeError):
    """A rank died, hung past the timeout, or exited non-zero; no weights were written."""


def init_world(timeout_s: float) -> World:
    """Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR in the env)."""
    cuda = torch.cuda.is_available()
    # The timeout bounds every collective: a rank that hangs fails its peers instead of blocking them.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    return World(rank, dist.get_world_size(), device)


def decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The transformer blocks of an HF causal LM (the units FSDP2 shards one by one)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers: not a decoder FSDP2 can shard by block")
    return layers


def shard(model: nn.Module, reshard_after_forward: bool = True, comms: str = "shm",
          clock: collectives.CommClock | None = None, precision: str = "fp32") -> nn.Module:
    """Shards each block, then the rest (embeddings, norm, head), over the default process group.
    `reshard_after_forward=False` keeps each block's gathered weights from its forward to its
    backward (one all-gather a block fewer a micro-batch, a block's full weights held meanwhile).
    `comms`: on gloo, the all-gathers and reduce-scatters through shared memory where the ranks
    share a host ("shm", else rings), as rings of paired sends ("ring") or gloo's own ("gloo")
    (training/rl/collectives.py); on gloo they are timed on `clock`.

    `precision` "bf16" (the step runs under bf16 autocast, as one process runs it): each block's
    weights are cast to bf16 on their shard and gathered in bf16 (half the bytes; FSDP2's
    MixedPrecisionPolicy), the values autocast would have cast them to for its matmuls, and their
    gradients reduced in float32 into the float32 masters. The blocks' inputs stay float32 (the
    residual stream is float32 as in one process); the rest (embeddings, final norm, head) is
    gathered in float32. What differs from one process: a block's norm weights are rounded to bf16."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    blocks = MixedPrecisionPolicy()
    if precision == "bf16":
        blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=blocks)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # the setting is per sharded module, not inherited
            # The loss is already divided by the step's global token count: sum the ranks' gradients.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; a factor of 1 needs none
    collectives.install(model, comms, clock)  # on gloo: shared memory or rings, faster than its own
    return model


def rank_share(batch: Batch, world: World) -> Batch:
    """This rank's rows: contiguous equal shares, padded with rows the loss ignores so every rank
    runs the same number of micro-batches (each forward is a collective under FSDP2)."""
    per = -(-batch.size // world.size)
    index = torch.arange(world.rank * per, (world.rank + 1) * per)
    real = index < batch.size
    mine = batch.rows(torch.where(real, index, torch.zeros_like(index)))
    keep = real[:, None]  # (b, 1)
    return replace(mine, completion_mask=mine.completion_mask & keep, behaviour_mask=mine.behaviour_mask & keep,
                   advantages=torch.where(real, mine.advantages, 0.0))


def distributed_rl_step(
    model: nn.Module, ref_model: nn.Module | None, batch: Batch, optimizer: torch.optim.Optimizer,
    cfg: RLConfig, world: World,
) -> StepMetrics:
    """`rl_step` over the whole `batch` (every rank passes the same one), each rank computing its share."""
    start = time.perf_counter()
    total_tokens = int(batch.completion_mask.sum())
    normalizer = float(max(total_tokens, 1))
    # Every rank must forward the same modules as often: the shared-prefix path forwards a
    # data-dependent number of times, so it is off under FSDP2.
    cfg = replace(cfg, shared_prefix=False)
    mine = rank_share(batch, world)
    optimizer.zero_grad(set_to_none=True)
    sums, drift, replayed, differed = backward_batch(model, ref_model, mine, cfg, normalizer)
    totals = torch.tensor([sums["loss"], *(sums[k] for k in METRIC_KEYS), *astuple(drift), replayed, differed],
                          dtype=torch.float64)
    dist.all_reduce(totals)
    grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip))
    optimizer.step()
    values = totals.tolist()
    summed = dict(zip(("loss", *METRIC_KEYS), values[: len(METRIC_KEYS) + 1], strict=True))
    drift = DriftSums(*values[len(METRIC_KEYS) + 1: -2])
    return StepMetrics(
        **summed, **drift.means(), grad_norm=grad_norm, reward_mean=float(batch.rewards.mean()),
        tokens_per_s=float(batch.attention_mask.sum()) / (time.perf_counter() - start),
        dropped_stale=batch.dropped_stale, tokens=total_tokens,
        routing_mismatch=values[-1] / values[-2] if values[-2] else 0.0,
    )


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on every rank's CPU (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------------------- a job


@dataclass(frozen=True)
class JobSpec:
    """What a distributed run is asked to do; `batches.pt` beside it holds one Batch per step."""

    policy: str  # HF folder of the weights the run starts from
    rl: dict[str, Any]
    reference: str | None = None  # HF folder of the KL reference; None: no reference model
    seed: int = 0
    timeout_s: float = 300.0
    optimizer: str | None = None  # a previous job's `optim/` (torch.distributed.checkpoint): resume AdamW
    reshard_after_forward: bool = True  # False: fewer all-gathers, more memory (`shard`)
    adapter: str | None = None  # a PEFT adapter folder over `policy`: the job trains it alone (LoRA)
    comms: str = "shm"  # gloo's all-gathers and reduce-scatters: "shm", "ring" or "gloo" (`shard`)
    # The run's compute precision, resolved by the caller ("fp32" or "bf16", never "auto": every
    # rank computes as the worker that launched it decided, whatever hardware a rank is on).
    precision: str = "fp32"

    def __post_init__(self) -> None:
        collectives.check_mode(self.comms)
        if self.precision not in SERVING_DTYPES:
            raise ValueError(f"a job's precision must be one of {list(SERVING_DTYPES)} (resolve \"auto\" with "
                             f"training.rl.precision.resolve_precision first), got {self.precision!r}")

    def write(self, folder: Path, batches: Sequence[Batch]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "spec.json").write_text(json.dumps(asdict(self)))
        torch.save([asdict_batch(b) for b in batches], folder / "batches.pt")

    @classmethod
    def read(cls, folder: Path) -> tuple[JobSpec, list[Batch]]:
        spec = cls(**json.loads((folder / "spec.json").read_text()))
        return spec, [Batch(**b) for b in torch.load(folder / "batches.pt", weights_only=True)]


def asdict_batch(batch: Batch) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


def _load(folder: str, world: World) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(world.device)


def run_job(folder: Path) -> None:
    """One rank's part of a job (torchrun starts one per process); its stages' seconds and what it
    holds go to `rank-<r>.json`."""
    spec, batches = JobSpec.read(folder)
    world = init_world(spec.timeout_s)
    pid_file = folder / f"rank-{world.rank}.pid"  # whole when it appears: the launcher watches for it
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").replace(pid_file)
    stages = _Stages()
    torch.manual_seed(spec.seed)
    cfg = RLConfig(**spec.rl)
    clock = collectives.CommClock()
    model = shard(_policy(spec, world), spec.reshard_after_forward, spec.comms, clock, spec.precision)
    ref = shard(_load(spec.reference, world).requires_grad_(False), comms=spec.comms, clock=clock,
                precision=spec.precision) if spec.reference else None
    trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapter's alone
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if spec.optimizer:
        optimizer_load(model, optimizer, spec.optimizer)
    stages.mark("load_s")
    comm_s: list[float] = []  # each step's seconds in the all-gathers and reduce-scatters (gloo)
    for step, batch in enumerate(batches):
        before = clock.seconds
        # bf16: forward and backward under autocast over the float32 masters, as one process runs it
        with compute_context(spec.precision, world.device):
            metrics = distributed_rl_step(model, ref, batch, optimizer, cfg, world)
        comm_s.append(round(clock.seconds - before, 4))
        if world.is_main:
            with open(folder / "metrics.jsonl", "a") as out:
                out.write(json.dumps({"step": step, **metrics.to_dict()}) + "\n")
    stages.mark("steps_s")
    memory = rank_memory(model, optimizer)
    optimizer_save(model, optimizer, folder / "optim")
    _save(model, spec, folder, world)
    # No rank tears down while another still works (rank 0 writes the weights after the gather).
    dist.barrier()
    stages.mark("save_s")
    # Written once every rank is past the save: the launcher reads "the job's work is complete"
    # from all of them, whatever the teardown below does.
    (folder / f"rank-{world.rank}.json").write_text(json.dumps({**memory, **stages.seconds, "comm_s": comm_s}))
    dist.destroy_process_group()


def _age_s() -> float:
    """Seconds since this process started (Linux's /proc; 0 where there is none)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class _Stages:
    """Seconds of a rank's stages: imports (from the interpreter's start), load, steps, save."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.seconds = {"import_s": round(_age_s() - (self.last - _IMPORTED), 3)}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 3)
        self.last = now


def optimizer_save(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """AdamW's sharded state, each rank writing its own shards (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def optimizer_load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Resumes AdamW from `optimizer_save`'s folder (resharded if the rank count changed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(model, optimizer)}  # its shapes: what to load into
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optim"])


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard
    return local.numel() * local.element_size()


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """What this rank holds: the bytes of its weights, gradients and optimiser state (what
    sharding divides), and the process's peak resident memory (which also holds activations)."""
    import resource

    params = list(model.parameters())
    state = [v for per in optimizer.state.values() for v in per.values() if isinstance(v, torch.Tensor)]
    held = sum(_local_bytes(p) for p in params) + sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    held += sum(_local_bytes(v) for v in state if v.dim() > 0)
    return {"state_mb": held / 2**20, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _policy(spec: JobSpec, world: World) -> nn.Module:
    """The weights the job trains: the policy, or with `spec.adapter` the policy frozen under that
    LoRA adapter (PEFT's layers in place; only the adapter requires a gradient)."""
    model = _load(spec.policy, world)
    if spec.adapter is None:
        return model
    from training.rl.lora import adapter_of, lora_attach

    return lora_attach(model, adapter_of(Path(spec.adapter)), Path(spec.adapter))


def _save(model: nn.Module, spec: JobSpec, folder: Path, world: World) -> None:
    """Rank 0 writes the gathered weights: the HF folder, or of a LoRA job the adapter alone in
    PEFT's layout (its base is `spec.policy`, unchanged)."""
    state = full_state_dict(model)
    if not world.is_main:
        return
    plain = _policy(spec, World(0, 1, torch.device("cpu")))
    plain.load_state_dict(state)
    if spec.adapter is not None:
        from training.rl.lora import lora_save

        lora_save(plain, folder / "policy.partial")
        (folder / "policy.partial").rename(folder / "policy")
        return
    plain.save_pretrained(folder / "policy.partial")
    for extra in Path(spec.policy).iterdir():  # the tokenizer and chat template travel with the weights
        if extra.is_file() and not (folder / "policy.partial" / extra.name).exists():
            (folder / "policy.partial" / extra.name).write_bytes(extra.read_bytes())
    (folder / "policy.partial").rename(folder / "policy")  # present only once complete


# ---------------------------------------------------------------------------------- the launcher


@dataclass(frozen=True)
class JobResult:
    policy: Path
    metrics: list[dict[str, Any]]


def torchrun_command(folder: Path, nproc: int, nodes: Nodes | None = None) -> list[str]:
    """`torchrun` for a job folder: one node by default (a free local port); several nodes with
    `nodes` (training/rl/nodes.py: the same command on every node, its own node rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *(nodes or Nodes()).args()]
    return [*cmd, "-m", "training.rl.distributed", str(folder)]


def launch(folder: Path, nproc: int, timeout_s: float, on_metrics: Callable[[dict[str, Any]], None] | None = None,
           threads: int = 1, nodes: Nodes | None = None) -> JobResult:
    """Runs a written job under torchrun, handing each step's metrics to `on_metrics` as rank 0
    writes them; raises DistributedRunFailed (with the log's tail) when a rank fails or the whole
    job outlives `timeout_s` (its process group is killed)."""
    log, seen = folder / "torchrun.log", _MetricsTail(folder / "metrics.jsonl", on_metrics)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(torchrun_command(folder, nproc, nodes), stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        deadline, ranks = time.monotonic() + timeout_s, _LocalRanks(folder, proc.pid)
        while proc.poll() is None:
            seen.read()
            if time.monotonic() > deadline:
                _stop(proc)
                raise DistributedRunFailed(f"the job outlived {timeout_s:.0f} s and was killed; {_tail(log)}")
            ended = ranks.ended_early()
            if ended:
                # torchrun would now give the others SIGTERM and wait 30 s before SIGKILL: a rank
                # stuck in a collective (or stopped) ignores SIGTERM, so that wait is all spent.
                _stop(proc)
                which = f"rank {ended[0]}" if len(ended) == 1 else "ranks " + ", ".join(map(str, ended))
                raise DistributedRunFailed(f"{which} ended before its part of the job was complete, so the job "
                                           f"was stopped; {_tail(log)}")
            time.sleep(0.2)
    seen.read()
    ranks = nproc * (nodes or Nodes()).nnodes
    if proc.returncode != 0 and completed(folder, ranks):
        # Every rank passed the final barrier and wrote its record, and the weights are whole: a
        # rank died in its teardown (gloo's threads at exit), after the work. Kept, and said.
        _log.warning("torchrun exited %s after all %s ranks completed the job in %s; kept its weights; %s",
                     proc.returncode, ranks, folder, _tail(log, 600))
    elif proc.returncode != 0 or not (folder / "policy").is_dir():
        raise DistributedRunFailed(f"torchrun exited {proc.returncode}; {_tail(log)}")
    return JobResult(folder / "policy", seen.lines)


def _stop(proc: subprocess.Popen) -> None:
    """torchrun and every process under it, at once, and waits for them to be gone. Its ranks run
    in sessions of their own (the elastic agent starts them so): the launch's process group alone
    would leave them running."""
    under = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in under:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    # Gone before the next job starts: a killed process frees its memory as it exits, which takes
    # a moment for a rank's address space (it is still running, in the kernel, until then).
    deadline = time.monotonic() + 30
    while any((stat := _proc_stat(pid)) is not None and stat[0] != "Z" for pid in under):
        if time.monotonic() > deadline:
            _log.warning("processes %s of a stopped job had not exited 30 s after SIGKILL", under)
            break
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    """Every live process under `root` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):  # no /proc: torchrun's own process group is all there is
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class _LocalRanks:
    """The ranks torchrun started on this node, known by the `rank-<r>.pid` each writes once its
    process group is up (a child of `agent`: a shared folder also holds other nodes' pid files),
    and the first one to end without its record (`rank-<r>.json`, written after the work)."""

    def __init__(self, folder: Path, agent: int) -> None:
        self.folder, self.agent = folder, agent
        self.pids: dict[int, int] = {}

    def ended_early(self) -> list[int]:
        for path in self.folder.glob("rank-*.pid"):
            rank = int(path.stem.removeprefix("rank-"))
            if rank not in self.pids:
                pid = int(path.read_text())
                stat = _proc_stat(pid)
                if stat is not None and stat[1] == self.agent:
                    self.pids[rank] = pid
        # Gone or a zombie (torchrun has not reaped it yet), and the record written before a rank's
        # normal end is missing: it failed (a rank that dies in its teardown after the record is
        # not this; `launch` keeps that job's weights).
        return [rank for rank, pid in sorted(self.pids.items())
                if ((stat := _proc_stat(pid)) is None or stat[0] == "Z")
                and not (self.folder / f"rank-{rank}.json").exists()]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process `pid` from /proc; None when it is gone (or there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def completed(folder: Path, ranks: int) -> bool:
    """Whether a job's work is whole: the weights' folder (renamed into place once complete) and
    every rank's record (written after the barrier that follows the save)."""
    return (folder / "policy").is_dir() and all((folder / f"rank-{r}.json").is_file() for r in range(ranks))


class _MetricsTail:
    """The complete lines rank 0 has appended to metrics.jsonl so far, each handed on once."""

    def __init__(self, path: Path, on_metrics: Callable[[dict[str, Any]], None] | None) -> None:
        self.path, self.on_metrics, self.lines = path, on_metrics, []

    def read(self) -> None:
        if not self.path.exists():
            return
        complete = self.path.read_text().split("\n")[:-1]  # the last piece may be half-written
        for line in complete[len(self.lines):]:
            self.lines.append(json.loads(line))
            if self.on_metrics:
                self.on_metrics(self.lines[-1])


_CAUSES = ("terminate called", "what():", "Error", "error:", "enforce fail", "Fatal", "Killed")


def _tail(log: Path, chars: int = 1500) -> str:
    """The log's end (torchrun's summary) after the first lines that name a cause: a rank that
    aborts (SIGABRT) says why in its own lines, well before torchrun's report of it."""
    text = log.read_text(errors="replace") if log.exists() else ""
    causes = [line for line in text.splitlines() if any(c in line for c in _CAUSES)][:6]
    head = ("first errors: " + " | ".join(line.strip()[:300] for line in causes) + "; ") if causes else ""
    return head + "log: " + text[-chars:]


if __name__ == "__main__":
    run_job(Path(sys.argv[1]))
    # The work is done and the process group destroyed. Leave without the interpreter's and
    # C++'s teardown: a rank aborted there now and then ("terminate called without an active
    # exception", SIGABRT, from a thread still joinable at exit), failing a finished job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
