"""Run by tests/feedback/test_export.py in the bench's TRL venv (never imported by the suite):
load each exported file with `datasets.load_dataset("json")`, check TRL's conversational format,
and train one optimiser step with the matching trainer on the tiny policy.

    var/bench-trl-venv/bin/python tests/feedback/_trl_check.py POLICY_DIR '{"kto": "kto.jsonl", ...}'
"""

from __future__ import annotations

import json
import sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
from trl.data_utils import is_conversational

TRAINERS = {"messages": (SFTTrainer, SFTConfig), "kto": (KTOTrainer, KTOConfig), "preference": (DPOTrainer, DPOConfig)}


def one_step(folder: str, fmt: str, path: str) -> dict:
    dataset = load_dataset("json", data_files=path, split="train")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer_cls, config_cls = TRAINERS[fmt]
    args = config_cls(output_dir=f"out-{fmt}", max_steps=1, per_device_train_batch_size=2, report_to="none",
                      use_cpu=True, save_strategy="no", logging_steps=1, max_length=96, bf16=False,
                      gradient_checkpointing=False, dataloader_num_workers=0)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return {"rows": len(dataset), "conversational": all(is_conversational(row) for row in dataset),
            "steps": trainer.state.global_step}


if __name__ == "__main__":
    folder, files = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({fmt: one_step(folder, fmt, path) for fmt, path in files.items()}))
