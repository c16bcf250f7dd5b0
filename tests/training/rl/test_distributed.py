"""The RL update under torchrun with FSDP2 (gloo, 2 ranks on this CPU) against one process.

    .venv/bin/python -m pytest tests/training/rl/test_distributed.py -q
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from tests.processes import wait_until
from training.rl.config import RLConfig
from training.rl.distributed import DistributedRunFailed, JobSpec, launch
from training.rl.precision import compute_context
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


def _one_process(policy: Path, batches: list, metric: str = "loss") -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    cfg = RLConfig(**RL)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    values = [getattr(rl_step(model, ref, b, optimizer, cfg), metric) for b in batches]
    return values, model.state_dict()


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
    for rank in (0, 1):  # each step's seconds in the all-gathers and reduce-scatters, in the rank's record
        record = json.loads((tmp_path / "first" / f"rank-{rank}.json").read_text())
        assert len(record["comm_s"]) == 2 and all(s > 0 for s in record["comm_s"]), record
    assert [m["loss"] for m in seen] == pytest.approx(losses, abs=1e-5)
    sharded = AutoModelForCausalLM.from_pretrained(result.policy, dtype=torch.float32).state_dict()
    worst = max(float((sharded[k] - weights[k]).abs().max()) for k in weights)
    assert worst < 1e-5, f"2-rank weights differ from 1 process by {worst}"
    moved = max(float((weights[k] - v).abs().max()) for k, v in
                AutoModelForCausalLM.from_pretrained(tiny_policy_dir).state_dict().items())
    assert moved > 1e-4  # the comparison is between weights that trained, not two copies of the start


def test_a_bf16_job_computes_on_its_ranks_as_one_bf16_process_does(tmp_path, tiny_policy_dir):
    """precision "bf16": the ranks' forward and backward run under bf16 autocast over float32 masters,
    as `Updates` runs one process. The first step's loss and entropy (the forward of the weights
    both start from) match that process's to float64 summation order, and differ from the float32
    forward's by bf16's rounding, 100x more than that."""
    batches = _batches(steps=1, rows=7, vocab=384)
    bf16, fp32 = {}, {}
    for metric in ("loss", "entropy"):
        fp32[metric] = _one_process(tiny_policy_dir, batches, metric)[0][0]
        with compute_context("bf16"):
            bf16[metric] = _one_process(tiny_policy_dir, batches, metric)[0][0]
    seen: list[dict] = []
    result = launch(_job(tmp_path, tiny_policy_dir, batches, precision="bf16"), nproc=2, timeout_s=300,
                    on_metrics=seen.append)
    for metric in ("loss", "entropy"):
        gap, rounding = abs(seen[0][metric] - bf16[metric]), abs(fp32[metric] - bf16[metric])
        assert gap * 100 < rounding, (metric, seen[0][metric], bf16[metric], fp32[metric])
    from safetensors.torch import load_file

    weights = load_file(result.policy / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float32}  # the masters: bf16 is how they compute
    with pytest.raises(ValueError, match="resolve"):
        JobSpec(policy=str(tiny_policy_dir), rl=RL, precision="auto")


def test_a_bf16_lora_job_gathers_its_blocks_in_bf16_and_computes_as_one_bf16_process(tmp_path, tiny_policy_dir):
    """A LoRA job in bf16: the blocks (the frozen base and the adapter's layers in them) gathered in
    bf16, the first step's loss and entropy those of one bf16 process (the values autocast casts
    the weights to), and the adapter back in float32 masters."""
    from transformers import AutoModelForCausalLM

    from training.rl.config import AdapterConfig
    from training.rl.lora import lora_attach, lora_save

    adapter = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    torch.manual_seed(0)
    model = lora_attach(AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32), adapter)
    with torch.no_grad():  # B off zero: the adapter changes what the first step computes
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    lora_save(model, tmp_path / "start")
    batches = _batches(steps=1, rows=7, vocab=384)
    cfg = RLConfig(**RL)
    found = {}
    for precision in ("fp32", "bf16"):
        with compute_context(precision):
            found[precision] = rl_step(model, None, batches[0], torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    folder = tmp_path / "job"
    JobSpec(policy=str(tiny_policy_dir), rl=RL, adapter=str(tmp_path / "start"), precision="bf16").write(folder,
                                                                                                        batches)
    seen: list[dict] = []
    result = launch(folder, nproc=2, timeout_s=300, on_metrics=seen.append)
    for metric in ("loss", "entropy"):
        bf16, fp32 = getattr(found["bf16"], metric), getattr(found["fp32"], metric)
        assert abs(seen[0][metric] - bf16) * 100 < abs(fp32 - bf16), (metric, seen[0][metric], bf16, fp32)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(result.policy / "adapter_model.safetensors").values()} == {torch.float32}


def test_a_lora_adapter_on_two_ranks_trains_as_in_one_process(tmp_path, tiny_policy_dir):
    """PEFT's LoRA layers under fully_shard: only the adapter trains (AdamW holds no base state),
    and 2 ranks give the one-process losses and adapter within 1e-5 (float summation order)."""
    from transformers import AutoModelForCausalLM

    from training.rl.config import AdapterConfig
    from training.rl.lora import adapter_state_dict, lora_attach, lora_save

    adapter = AdapterConfig(kind="lora", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    torch.manual_seed(0)
    model = lora_attach(AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32), adapter)
    lora_save(model, tmp_path / "start")  # the adapter the job starts from (lora_A random, lora_B zero)
    batches = _batches(steps=3, rows=7, vocab=384)
    cfg = RLConfig(**RL)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    losses = [rl_step(model, None, b, optimizer, cfg).loss for b in batches]
    folder = tmp_path / "job"
    JobSpec(policy=str(tiny_policy_dir), rl=RL, adapter=str(tmp_path / "start")).write(folder, batches)
    seen: list[dict] = []
    result = launch(folder, nproc=2, timeout_s=300, on_metrics=seen.append)
    assert [m["loss"] for m in seen] == pytest.approx(losses, abs=1e-5)
    assert sorted(p.name for p in result.policy.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    from safetensors.torch import load_file

    sharded, alone = load_file(result.policy / "adapter_model.safetensors"), adapter_state_dict(model)
    assert set(sharded) == set(alone)
    worst = max(float((sharded[k] - alone[k]).abs().max()) for k in alone)
    assert worst < 1e-5, f"2-rank adapter differs from 1 process by {worst}"
    assert max(float(alone[k].abs().max()) for k in alone if ".lora_B." in k) > 1e-4  # B moved off zero
    # a rank holds half the frozen base and no gradient or AdamW moment of it (those would be
    # 1.5x the weights' bytes more): only the adapter has them
    rank = json.loads((folder / "rank-0.json").read_text())
    assert rank["state_mb"] < 0.6 * _full_state_mb(tiny_policy_dir)


def _full_state_mb(policy: Path) -> float:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(policy).parameters()) / 2**20


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
    # torchrun ends the other rank itself (SIGTERM, which it acts on) and may exit before the
    # launcher looks: either way the job fails
    with pytest.raises(DistributedRunFailed, match="torchrun exited|ranks? [0-9, ]*1 ended before its part"):
        launch(folder, nproc=2, timeout_s=300)
    watcher.join()
    assert not (folder / "policy").exists()


def test_a_hung_rank_is_timed_out_and_writes_no_weights(tmp_path, tiny_policy_dir):
    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=400, rows=4, vocab=384), timeout_s=5)
    stopped = []
    watcher = _while_running(folder, lambda pid: (stopped.append(pid), os.kill(pid, signal.SIGSTOP)))
    # rank 0's collective times out (5 s) and it ends; the launcher stops the job then, rank 1
    # with it, rather than wait out torchrun's 30 s between SIGTERM (which a stopped rank never
    # acts on) and SIGKILL
    with pytest.raises(DistributedRunFailed, match="rank 0 ended before its part of the job was complete"):
        launch(folder, nproc=2, timeout_s=240)
    watcher.join()
    assert not (folder / "policy").exists()
    stat = Path(f"/proc/{stopped[0]}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # killed with the job
    assert "forcefully exiting" not in (folder / "torchrun.log").read_text()  # torchrun's 30-s path


def test_a_job_that_outlives_its_time_is_killed_with_every_rank(tmp_path, tiny_policy_dir):
    # 1,000 steps: over 30 s of work on 2 cores, well past the 12 s this job is given
    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=1000, rows=4, vocab=384))
    with pytest.raises(DistributedRunFailed, match="the job outlived 12 s and was killed"):
        launch(folder, nproc=2, timeout_s=12)
    assert not (folder / "policy").exists()
    pids = [int(p.read_text()) for p in folder.glob("rank-*.pid")]
    assert len(pids) == 2  # both ranks were up, and neither is left training (in a session of its own)
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


# A rank that aborts once its work is done, as gloo's teardown did now and then in CI ("terminate
# called without an active exception", SIGABRT): loaded into the ranks alone (torchrun sets
# LOCAL_RANK for them, not for its agent) through Python's sitecustomize.
_ABORT_AT_EXIT = """
import os, signal
if "LOCAL_RANK" in os.environ and os.environ.get("ABORT_RANK") == os.environ["LOCAL_RANK"]:
    os._exit = lambda code: os.kill(os.getpid(), signal.SIGABRT)
"""


def test_a_rank_dying_in_its_teardown_after_the_work_keeps_the_job_and_says_so(tmp_path, tiny_policy_dir,
                                                                               monkeypatch, caplog):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_ABORT_AT_EXIT)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("ABORT_RANK", "1")
    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=1, rows=4, vocab=384))
    with caplog.at_level("WARNING", logger="training.rl.distributed"):
        result = launch(folder, nproc=2, timeout_s=300)
    assert (result.policy / "model.safetensors").exists() and len(result.metrics) == 1
    assert "after all 2 ranks completed the job" in caplog.text and "SIGABRT" in caplog.text  # the abort happened


def test_a_rank_dying_before_it_completed_still_fails_the_job(tmp_path, tiny_policy_dir):
    from training.rl.distributed import completed

    folder = _job(tmp_path, tiny_policy_dir, _batches(steps=1, rows=4, vocab=384))
    launch(folder, nproc=2, timeout_s=300)
    assert completed(folder, 2)
    (folder / "rank-1.json").unlink()  # rank 1 never got past the barrier after the save
    assert not completed(folder, 2) and not completed(tmp_path / "elsewhere", 1)
