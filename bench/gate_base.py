"""The gate's measurements of a base on the demo's held-out suite, and the thresholds derived from
them (training/gate/defaults.py): entropy per token at two seeds, the length spread, the invented-name
share, the collapse figures, the KL budget, length bound, median floor and log-prob tolerance.

    .venv/bin/python bench/gate_base.py                       # the demo base (bootstrap_policy's cache)
    .venv/bin/python bench/gate_base.py --steps 200 --json    # pretrain a base of that many steps first
    .venv/bin/python bench/gate_base.py --folder PATH         # any local HF folder
    .venv/bin/python bench/gate_base.py --quick               # a base of 2 steps on 5,000 lines, 8 prompts

The base is the demo's (`bootstrap_policy --steps N`: the default dense shape pretrained N steps on
the stdlib sources), read from var/policies/pretrained/dense-<N>steps/ when the demo cached it, else
built there. The suite is the demo's: 160 held-out stdlib line starts, 4 samples of 16 tokens. The
known names are the suite's and the language's (the gate adds the project's trajectories' prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference.engines import make_engine  # noqa: E402
from training.gate.config import SuiteSpec  # noqa: E402
from training.gate.defaults import base_measure  # noqa: E402
from training.gate.runner import intended_lines, suite_sample  # noqa: E402
from training.pretrain import PolicyConfig, build_policy, pretrain, sample_lines, stdlib_corpus  # noqa: E402
from training.rewards.usefulness import known_names  # noqa: E402


def demo_suite(prompts: int, samples: int, corpus: list[str] | None = None) -> SuiteSpec:
    """The demo's held-out suite (webapp/demo `_demo_suite_prompts`: the same lines, seed 7)."""
    lines = [line.strip() for line in (corpus or stdlib_corpus())[-20_000:]]
    held_out = sample_lines([line for line in lines if len(line) >= 12], prompts, seed=7)
    return SuiteSpec.from_json([{"id": f"stdlib-{i}", "prompt": line[:20],
                                 "context": {"prefix": line[:20], **({"rest": line[20:]} if line[20:] else {})}}
                                for i, line in enumerate(held_out)], n_samples=samples, max_tokens=16)


def base_folder(args: argparse.Namespace, var: Path, corpus: list[str] | None = None) -> Path:
    if args.folder:
        return Path(args.folder)
    cached = var / "policies" / "pretrained" / f"dense-{args.steps}steps"
    if not (cached / "pretrain.json").exists():
        print(f"pretraining the demo base for {args.steps} steps into {cached}", file=sys.stderr)
        building = cached.with_name(cached.name + ".gate-bench")
        shutil.rmtree(building, ignore_errors=True)
        corpus = corpus or stdlib_corpus()
        build_policy(building, PolicyConfig(kind="dense"), corpus[:60_000])
        stats = pretrain(building, corpus, float("inf"), max_steps=args.steps)
        (building / "pretrain.json").write_text(json.dumps(stats))
        building.rename(cached)
    return cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="the demo base's pretraining steps")
    parser.add_argument("--folder", default=None, help="measure this HF folder instead")
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="a base of 2 steps on 5,000 lines in a temp folder, 8 prompts x 2 samples: that it runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.steps, args.prompts, args.samples = 2, 8, 2
            corpus = stdlib_corpus(5_000)
            folder, spec = base_folder(args, Path(tmp), corpus), demo_suite(args.prompts, args.samples, corpus)
        else:
            var = Path(os.environ.get("FLYWHEEL_VAR_DIR", ROOT / "var"))
            folder, spec = base_folder(args, var), demo_suite(args.prompts, args.samples)
        measure, seconds = _measure(folder, spec)
    rows = [("entropy per token (seed 0, 1)", " / ".join(f"{h:.3f}" for h in measure["entropy_by_seed"])),
            ("mean log-prob per token of its own samples", f"{-measure['entropy']:.3f}"),
            ("tokens: mean / p25 / p75", f"{measure['tokens_mean']:.2f} / {measure['tokens_p25']:g} / "
                                         f"{measure['tokens_p75']:g}"),
            ("shown characters: p25 / median", f"{measure['chars_p25']:g} / {measure['chars_median']:g}"),
            ("invented-name share", f"{measure['invented_share']:.3f}"),
            ("most common suggestion's share", f"{measure['top_share']:.3f}"),
            ("distinct-suggestion rate", f"{measure['distinct_rate']:.3f}"),
            ("mean NLL per token of the lines people typed", _figure(measure["intended_nll"])),
            *((f"derived {k}", _figure(v)) for k, v in measure["derived"].items()),
            ("sampling seconds (2 seeds)", f"{seconds:.1f}")]
    print(f"base {folder} on {len(spec.prompts)} prompts x {spec.n_samples} samples x {spec.max_tokens} tokens")
    for name, value in rows:
        print(f"  {name:<44} {value}")
    if args.json:
        print(json.dumps({"folder": str(folder), "quick": args.quick, **measure}))


def _figure(value: float | None) -> str:
    return "n/a (the suite has no lines people typed)" if value is None else f"{value:g}"


def _measure(folder: Path, spec: SuiteSpec) -> tuple[dict, float]:
    """The gate's base measurements of `folder` on `spec` at seeds 0 and 1 (with its log-probs of
    the lines people were about to type, teacher-forced), and the sampling seconds."""
    engine = make_engine("torch", folder, version=1)
    start = time.monotonic()
    try:
        sets = [suite_sample(spec, engine, seed) for seed in (0, 1)]
        rests = intended_lines(spec)
        pairs = [(engine.encode(p.prompt), engine.encode(rests[p.id].split("\n", 1)[0]))
                 for p in spec.prompts if p.id in rests]
        intended = [lp for lp, _ in engine.score_many([pair for pair in pairs if pair[1]])]
    finally:
        engine.close()
    seconds = time.monotonic() - start
    prompts = {p.id: p.prompt for p in spec.prompts}
    return base_measure(sets, (0, 1), prompts, known_names(prompts.values()), intended).as_dict(), seconds


if __name__ == "__main__":
    main()
