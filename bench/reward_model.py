"""Users' reward models on intent-taste clicks: held-out AUC against the clicks fitted on.

    .venv/bin/python bench/reward_model.py            # table
    .venv/bin/python bench/reward_model.py --json     # table, then one JSON line last
    .venv/bin/python bench/reward_model.py --quick    # 5 steps, 100 clicks on 1,000 lines: that it runs
    .venv/bin/python bench/reward_model.py --base var/policies/pretrained/dense-1000steps   # the demo's base

A tiny policy (the tests' shape) is pretrained `--steps` steps on standard-library lines; clicks
are built offline (training.rewards.intent_clicks: users accept what they were about to type;
right, partially right, wrong and sampled suggestions) on lines it was pretrained on ("seen") and
on lines it never saw ("unseen"). For each click count both models are fitted on the oldest 80%
and scored on the newest 20% (their own calibration slice), and `fit_users_model`'s choice shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.pretrain import PolicyConfig, build_policy, load_tokenizer, pretrain, stdlib_corpus  # noqa: E402
from training.rewards.intent_clicks import code_cases, intent_clicks  # noqa: E402
from training.rewards.reward_model import fit_context_model, fit_reward_model, fit_users_model  # noqa: E402

torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a busy machine
TINY = dict(vocab_size=384, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position=128)
SEEN, UNSEEN = slice(0, 8000), slice(8000, 16000)


def _policy(folder: Path, lines: list[str], steps: int) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    if lines:  # else: a pretrained folder, read as it is
        build_policy(folder, PolicyConfig(**TINY), lines[:3000])
        pretrain(folder, lines, seconds=float("inf"), batch_size=16, seq_len=64, max_steps=steps)
    tokenizer = load_tokenizer(folder)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(), tokenizer


def _rows(name: str, lines: list[str], policy: Any, tokenizer: Any, sizes: list[int], seed: int) -> list[dict]:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    clicks = intent_clicks(code_cases(lines, max(sizes), seed=seed), policy, encode, tokenizer.decode, seed=seed)
    rows = []
    for n in sizes:
        start = time.perf_counter()
        features, context = fit_reward_model(clicks[:n]), fit_context_model(clicks[:n], policy, encode)
        chosen = fit_users_model(clicks[:n], policy=policy, encode=encode)
        rows.append({"lines": name, "clicks": n, "features_auc": features.calibration.get("heldout_auc"),
                     "context_auc": context.calibration.get("heldout_auc"),
                     "chosen": chosen.calibration["kind"] if chosen else None,
                     "accept_rate": context.calibration["accept_rate"], "fit_s": round(time.perf_counter() - start, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps of the tiny policy")
    parser.add_argument("--sizes", default="500,1000,2000", help="click counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", default=None, metavar="FOLDER",
                        help="a pretrained policy folder (e.g. the demo's base) instead of the tiny policy")
    parser.add_argument("--quick", action="store_true", help="5 steps, 100 clicks on 1,000 lines: that the bench runs")
    args = parser.parse_args()
    seen, unseen = (slice(0, 1000), slice(1000, 2000)) if args.quick else (SEEN, UNSEEN)
    if args.quick:
        args.steps, args.sizes = 5, "100"
    sizes = [int(s) for s in args.sizes.split(",")]
    corpus = stdlib_corpus(unseen.stop)
    seen_lines, unseen_lines = corpus[seen], corpus[unseen]
    if args.base:
        unseen_lines = _django_lines(unseen.stop - unseen.start)
    with tempfile.TemporaryDirectory() as tmp:
        policy, tokenizer = (_policy(Path(args.base), [], 0) if args.base
                             else _policy(Path(tmp), seen_lines, args.steps))
        rows = _rows("seen", seen_lines, policy, tokenizer, sizes, args.seed)
        rows += _rows("unseen", unseen_lines, policy, tokenizer, sizes, args.seed)
    print(f"{'lines':<7} {'clicks':>6} {'accept':>6} {'features AUC':>12} {'context AUC':>11} {'chosen':>8} {'fit s':>6}")
    for r in rows:
        print(f"{r['lines']:<7} {r['clicks']:>6} {r['accept_rate']:>6.3f} {_auc(r['features_auc']):>12} "
              f"{_auc(r['context_auc']):>11} {r['chosen']!s:>8} {r['fit_s']:>6}")
    if args.json:
        print(json.dumps({"bench": "reward_model", "steps": args.steps, "base": args.base, "seed": args.seed, "quick": args.quick,
                          "rows": rows}))


def _django_lines(n: int) -> list[str]:
    """The first `n` non-blank lines of django's sources, files in a fixed (sorted) order."""
    import django

    lines: list[str] = []
    for path in sorted(Path(django.__file__).parent.rglob("*.py")):
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if len(line.strip()) >= 8]
        if len(lines) >= n:
            break
    return lines[:n]


def _auc(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
