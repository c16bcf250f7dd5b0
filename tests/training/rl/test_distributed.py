"""The RL update under torchrun with FSDP2 (gloo, 2 ranks on this CPU) against one process.

    .venv/bin/python -m pytest tests/training/rl/test_distributed.py -q
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from tests.processes import wait_until
from training.rl.config import RLConfig
from training.rl.distributed import DistributedRunFailed, JobSpec, launch
from training.rl.trainer import Sample, prepare_batch, rl_step

RL = dict(lr=1e-3, beta=0.05, micro_batch_size=2, shared_prefix=False)


def _batches(steps: int, rows: int, vocab: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    cfg = RLConfig(**RL)
    batches = []
    for _ in range(steps):
        samples = []
        for i in range(rows):
            prompt = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen)
            completion = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
            samples.append(Sample(prompt.tolist(), completion.tolist(), reward=float(i % 3) - 1.0,
                                  behaviour_logprobs=[-2.0] * len(completion), group=i // 3))
        batches.append(prepare_batch(samples, current_version=1, cfg=cfg, pad_id=0))
    return batches


def _one_process(policy: Path, batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    cfg = RLConfig(**RL)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses = [rl_step(model, ref, b, optimizer, cfg).loss for b in batches]
    return losses, model.state_dict()


def _job(tmp_path: Path, policy: Path, batches: list, name: str = "job", reference: Path | None = None,
         **spec) -> Path:
    folder = tmp_path / name
    JobSpec(policy=str(policy), rl=RL, reference=str(reference or policy), **spec).write(folder, batches)
    return folder


def test_two_ranks_give_the_one_process_losses_and_weights(tmp_path, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    batches = _batches(steps=3, rows=7, vocab=384)  # 7 rows: the second rank's share is padded
    losses, weights = _one_process(tiny_policy_dir, batches)
    seen: list[dict] = []
    first = launch(_job(tmp_path, tiny_policy_dir, batches[:2], "first"), nproc=2, timeout_s=300,
                   on_metrics=seen.append)
    # the second job resumes the first's weights and its sharded AdamW state, as a run's later rounds do
    second = _job(tmp_path, first.policy, batches[2:], "second", reference=tiny_policy_dir,
                  optimizer=str(tmp_path / "first" / "optim"))
    result = launch(second, nproc=2, timeout_s=300, on_metrics=seen.append)
    assert [m["step"] for m in seen] == [0, 1, 0]
    assert [m["loss"] for m in seen] == pytest.approx(losses, abs=1e-5)
    sharded = AutoModelForCausalLM.from_pretrained(result.policy, dtype=torch.float32).state_dict()
    worst = max(float((sharded[k] - weights[k]).abs().max()) for k in weights)
    assert worst < 1e-5, f"2-rank weights differ from 1 process by {worst}"
    moved = max(float((weights[k] - v).abs().max()) for k, v in
                AutoModelForCausalLM.from_pretrained(tiny_policy_dir).state_dict().items())
    assert moved > 1e-4  # the comparison is between weights that trained, not two copies of the start


def _while_running(folder: Path, act) -> threading.Thread:
    def watch() -> None:
        wait_until(lambda: (folder / "rank-1.pid").exists() and (folder / "metrics.jsonl").exists(), timeout=150,
                   every=0.05, what="rank 1 started and a step finished")
        act(int((folder / "rank-1.pid").read_text()))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_killed_rank_fails_the_job_and_writes_no_weights(tmp_path, tiny_policy_dir):
    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=400, rows=4, vocab=384))
    watcher = _while_running(folder, lambda pid: os.kill(pid, signal.SIGKILL))
    with pytest.raises(DistributedRunFailed, match="torchrun exited"):
        launch(folder, nproc=2, timeout_s=300)
    watcher.join()
    assert not (folder / "policy").exists()


def test_a_hung_rank_is_timed_out_and_writes_no_weights(tmp_path, tiny_policy_dir):
    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=400, rows=4, vocab=384), timeout_s=5)
    watcher = _while_running(folder, lambda pid: os.kill(pid, signal.SIGSTOP))
    with pytest.raises(DistributedRunFailed):
        launch(folder, nproc=2, timeout_s=240)
    watcher.join()
    assert not (folder / "policy").exists()
