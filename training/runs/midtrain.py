"""A mid-training run, top to bottom: the base weights (production or a given version), the
corpus's training files packed into fixed-length rows (training/corpora/packing.py), next-token
AdamW steps for `steps` or `minutes` (each step's metrics handed to `on_step`) of every weight or,
with `"adapter"` in the run's settings, of a LoRA adapter over the frozen base, the candidate
saved to a folder. `training.runs.services.train_policy` owns the run's state around it, as for RL
runs, so the candidate goes through the same store, delta, gate, approval and audit.

    .venv/bin/python manage.py midtrain --project SLUG --minutes 5
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from training.corpora.config import MidtrainConfig
from training.corpora.packing import pack_rows, train_rows
from training.corpora.selectors import corpus_get, corpus_texts
from training.models import TrainingRun
from training.rl.config import AdapterConfig
from training.runs.job import setup_policy
from training.runs.updates import StepCallback, save_candidate
from training.versions.services import policy_folder

NOT_MEASURED = 0.0


def corpus_rows(run: TrainingRun, cfg: MidtrainConfig, tokenizer: Any, max_len: int) -> torch.Tensor:
    """The corpus's training files (never its held-out slice) as packed rows, (R, T)."""
    corpus = corpus_get(run.project, cfg.corpus)
    texts = [text for _, text in corpus_texts(corpus, heldout=False)]
    if not texts:
        raise ValueError(f"corpus {corpus.pk} has no training files (all are held out)")
    docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return pack_rows(docs, int(eos), min(cfg.seq_len, max_len))


def run(run: TrainingRun, folder: Path, on_step: StepCallback) -> dict[str, Any]:
    """Trains and saves the candidate into `folder`; returns the run's result."""
    cfg = MidtrainConfig.from_dict(run.settings["midtrain"])
    torch.manual_seed(cfg.seed)
    base_dir = policy_folder(run.base_version)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = setup_policy(run.base_version, AdapterConfig.from_value(run.settings.get("adapter")))
    rows = corpus_rows(run, cfg, tokenizer, int(getattr(model.config, "max_position_embeddings", cfg.seq_len)))

    def step(done: int, m: dict[str, Any]) -> None:  # the RL columns of a TrainingStep row mean nothing here
        on_step(done, cfg.steps or 1, {**m, "kl_ref": NOT_MEASURED, "entropy": NOT_MEASURED,
                                       "clip_fraction": NOT_MEASURED, "reward_mean": NOT_MEASURED,
                                       "mismatch_kl": None, "staleness_kl": None, "dropped_stale": 0})

    out = train_rows(model, rows, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed, steps=cfg.steps,
                     seconds=cfg.minutes * 60 if cfg.minutes is not None else None, warmup=cfg.warmup, on_step=step)
    save_candidate(model, base_dir, folder)
    return {"steps": out["steps"], "midtrain_rows": int(rows.shape[0]), "midtrain_seq_len": int(rows.shape[1]),
            "midtrain_tokens": int(rows.numel()), **{f"midtrain_{k}": v for k, v in out.items() if k != "steps"}}
