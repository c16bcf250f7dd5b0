"""A run's optimiser steps: in this process (`Updates`), or on N processes under torchrun with
the policy sharded by FSDP2 (`DistributedUpdates`, when FLYWHEEL_TRAIN_NPROC > 1). Both take the
same seeded mini-batches and hand every step's metrics to `on_step` as the step finishes.

    FLYWHEEL_TRAIN_NPROC=2 .venv/bin/python -m pytest tests/training/runs/test_distributed_runs.py -q
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from django.conf import settings as django_settings
from transformers import PreTrainedModel

from training.rl.distributed import JobSpec, launch
from training.rl.lora import is_lora, lora_load, lora_save
from training.rl.nodes import Nodes
from training.rl.precision import compute_context, resolve_precision, serving_state_dict
from training.rl.trainer import Batch, rl_step
from training.runs.settings import RunSettings

StepCallback = Callable[[int, int, dict[str, Any]], None]


def make_updates(model: PreTrainedModel, ref_model: PreTrainedModel | None, ref_dir: Path | None,
                 settings: RunSettings, plan: tuple[int, int], on_step: StepCallback, base_dir: Path,
                 run_id: int) -> Updates:
    """This process's updates, or torchrun's when the deployment gives the train worker N > 1."""
    nproc, nnodes = int(django_settings.FLYWHEEL_TRAIN_NPROC), int(django_settings.FLYWHEEL_TRAIN_NNODES)
    if nproc <= 1 and nnodes <= 1:
        return Updates(model, ref_model, settings, plan, on_step)
    nodes = train_nodes()
    work = Path(django_settings.FLYWHEEL_CHECKPOINT_DIR) / "torchrun" / f"run-{run_id}"
    return DistributedUpdates(model, ref_model, settings, plan, on_step, ref_dir=ref_dir, base_dir=base_dir,
                              nproc=nproc, work=work, nodes=nodes)


def train_nodes() -> Nodes:
    """The train worker's torchrun nodes, validated: it is node 0 (the others follow its jobs)."""
    nodes = Nodes(int(django_settings.FLYWHEEL_TRAIN_NNODES), int(django_settings.FLYWHEEL_TRAIN_NODE_RANK),
                  str(django_settings.FLYWHEEL_TRAIN_MASTER_ADDR), int(django_settings.FLYWHEEL_TRAIN_MASTER_PORT)).check()
    if nodes.nnodes > 1 and nodes.node_rank != 0:
        raise ValueError(f"the train worker runs node 0 of a run's torchrun jobs; this one has "
                         f"FLYWHEEL_TRAIN_NODE_RANK={nodes.node_rank}. Set it to 0 here, and run "
                         "`python -m training.rl.nodes FLYWHEEL_CHECKPOINT_DIR/torchrun` on the other nodes")
    return nodes


class Updates:
    """The run's optimiser steps: seeded shuffled mini-batches of `batch_size` rows, one
    `rl_step` each, every step's metrics handed to `on_step` with the planned total."""

    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, settings: RunSettings,
                 plan: tuple[int, int], on_step: StepCallback) -> None:
        self.model, self.ref_model, self.cfg, self.on_step = model, ref_model, settings.rl, on_step
        self.size, self.seed = settings.batch_size, settings.seed
        self.first_steps, self.planned = plan
        # fused: one kernel over all the parameters (5x faster a step on CPU than the per-tensor loop)
        # Only what trains: every weight, or a LoRA adapter's (its frozen base has no AdamW state).
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, fused=True)
        # bf16: forward and backward under autocast; the weights and AdamW's state stay float32 (masters).
        self.precision = resolve_precision(settings.precision)
        self.done = 0

    def take(self, batch: Batch, steps: int, seed: int) -> None:
        for mb in _take(_shuffled(batch, self.size, seed), steps):
            with compute_context(self.precision):
                metrics = rl_step(self.model, self.ref_model, mb, self.optimizer, self.cfg).to_dict()
            self.on_step(self.done, self.planned, metrics)
            self.done += 1

    def close(self) -> None:
        """Nothing to release in this process."""


def _take(batches: Iterator[Batch], n: int) -> Iterator[Batch]:
    for _, mb in zip(range(n), batches, strict=False):
        yield mb


def _shuffled(batch: Batch, size: int, seed: int) -> Iterator[Batch]:
    """Mini-batches of `size` rows, a fresh seeded permutation per pass (live samples and group
    rollouts mixed, not one after the other)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(batch.size, generator=gen)
        for start in range(0, batch.size, size):
            yield batch.rows(order[start : start + size])


class DistributedUpdates(Updates):
    """Each `take` is one torchrun job over the same mini-batches: the current weights go in as a
    folder, the sharded AdamW state carries over from the previous take (torch.distributed.checkpoint),
    the updated weights come back into `model` (so rollouts and the trust region see them)."""

    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, settings: RunSettings,
                 plan: tuple[int, int], on_step: StepCallback, *, ref_dir: Path | None, base_dir: Path,
                 nproc: int, work: Path, nodes: Nodes | None = None) -> None:
        self.model, self.ref_model, self.cfg, self.on_step = model, ref_model, settings.rl, on_step
        self.size, self.seed = settings.batch_size, settings.seed
        self.first_steps, self.planned = plan
        self.ref_dir, self.base_dir, self.nproc, self.nodes = ref_dir, base_dir, max(nproc, 1), nodes
        self.work = work  # a job folder per take: its batches, the ranks' pids and log, the weights back
        self.precision = resolve_precision(settings.precision)  # the ranks compute in it (bf16: autocast)
        self.optimizer_dir: Path | None = None
        self.done = 0

    def take(self, batch: Batch, steps: int, seed: int) -> None:
        folder = self.work / f"take-{self.done}"
        save_candidate(self.model, self.base_dir, _fresh(folder / "start"))
        lora = is_lora(self.model)  # the ranks train the adapter over the frozen base's folder
        spec = JobSpec(policy=str(self._frozen_base() if lora else folder / "start"), rl=asdict(self.cfg), seed=seed,
                       adapter=str(folder / "start") if lora else None,
                       reference=str(self.ref_dir) if self.ref_dir else None,
                       optimizer=str(self.optimizer_dir) if self.optimizer_dir else None,
                       timeout_s=float(django_settings.FLYWHEEL_TRAIN_COLLECTIVE_TIMEOUT_S),
                       precision=self.precision)
        spec.write(folder, list(_take(_shuffled(batch, self.size, seed), steps)))
        result = launch(folder, self.nproc, float(django_settings.FLYWHEEL_TRAIN_JOB_TIMEOUT_S),
                        on_metrics=self._stepped, nodes=self.nodes)
        _load_back(self.model, result.policy)
        if self.optimizer_dir is not None:
            shutil.rmtree(self.optimizer_dir.parent, ignore_errors=True)  # the take before: no longer needed
        self.optimizer_dir = folder / "optim"

    def _frozen_base(self) -> Path:
        """The weights under a LoRA run's adapter, as an HF folder written once a run: the model's
        own frozen base layers (of an adapter version, its stored base; not the merged folder)."""
        folder = self.work / "base"
        if not (folder / "config.json").exists():
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            plain.load_state_dict({k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items()
                                   if ".lora_" not in k})
            save_candidate(plain, self.base_dir, _fresh(folder))
        return folder

    def _stepped(self, metrics: dict[str, Any]) -> None:
        metrics = {k: v for k, v in metrics.items() if k != "step"}
        self.on_step(self.done, self.planned, metrics)
        self.done += 1

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _load_back(model: PreTrainedModel, folder: Path) -> None:
    """The gathered weights rank 0 wrote, into the run's model (of a LoRA model: its adapter)."""
    if is_lora(model):
        lora_load(model, folder)
        return
    from transformers import AutoModelForCausalLM

    model.load_state_dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict())


def _fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def save_candidate(model: PreTrainedModel, base_dir: Path, folder: Path, precision: str = "fp32") -> None:
    """The base folder's tokenizer and side files, with the trained weights in the serving dtype
    of `precision` (a resolved one: "fp32" or "bf16"); of a LoRA model, the adapter alone in
    PEFT's layout (its base's files are the base version's)."""
    if is_lora(model):
        lora_save(model, folder, precision)
        return
    for path in base_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            shutil.copy2(path, folder / path.name)
    if precision == "fp32":
        model.save_pretrained(folder)
        return
    model.save_pretrained(folder, state_dict=serving_state_dict(model.state_dict(), precision))
    # The config names the served dtype (save_pretrained writes the masters'), so a loader asked
    # for "auto" (vLLM) computes in it.
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
