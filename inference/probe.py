"""The probe a replica answers after every swap: fixed prompts, greedy, the sampled tokens and their
log-probs, compared with the trainer's for the same version (training/replicas/probe.py). A
wrong adapter, the base served instead of the adapter, a stale folder: the tokens or the
log-probs differ, and the swap is refused. Plain functions over an `Engine`; no Django.

Tolerances (max |log-prob difference| per token, greedy, the same tokens required), per engine
and dtype: torch fp32 1e-4 (the torch engine scores batch-invariantly: the trainer's bits for
full weights; an adapter applied per request vs the trainer's LoRA layers, measured <= 5e-7);
vLLM fp32 1e-3 (its CPU kernels and punica LoRA ops, measured <= 5e-6 on the tiny policies);
bf16 (either engine) 0.1, a bound not yet measured on a served bf16 replica: bf16 keeps 8 bits
of mantissa, and the trainer's own bf16 log-probs differ from its fp32 ones by 0.02-0.03 on the
tiny policies (tests/training/rl/test_precision.py). A wrong adapter moves them by 1e-1 or more.

    .venv/bin/python -m pytest tests/training/replicas/test_probe.py -q
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.engines.base import Engine, SamplingParams

PROBE_PROMPTS = ("def add(a, b):", "import os\n\n", "class Stack:\n    def push(self, item):")
PROBE_TOKENS = 8
TOLERANCES = {("torch", "float32"): 1e-4, ("vllm", "float32"): 1e-3,
              ("torch", "bfloat16"): 0.1, ("vllm", "bfloat16"): 0.1}


def tolerance(engine_kind: str, dtype: str = "float32") -> float:
    """The probe's tolerance for an engine kind (torch | vllm | vllm-async) and dtype."""
    family = "torch" if engine_kind == "torch" else "vllm"
    return TOLERANCES.get((family, dtype), TOLERANCES[(family, "float32")])


def probe_run(engine: Engine) -> dict[str, Any]:
    """The probe prompts' greedy continuations on `engine`: token ids and their log-probs."""
    greedy = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True)
    out = engine.generate(list(PROBE_PROMPTS), n=1, sampling=greedy)
    return {"tokens": [c.token_ids for c in out], "logprobs": [c.logprobs for c in out]}


@dataclass(frozen=True)
class ProbeVerdict:
    ok: bool
    max_diff: float  # over the tokens both sides sampled alike (inf when a token differs)
    problem: str = ""


def probe_compare(reference: dict[str, Any], answer: dict[str, Any], tol: float) -> ProbeVerdict:
    """The replica's answer against the trainer's reference: the same tokens, log-probs within tol."""
    worst = 0.0
    for k, (ref_t, ans_t) in enumerate(zip(reference["tokens"], answer["tokens"], strict=True)):
        if list(ref_t) != list(ans_t):
            return ProbeVerdict(False, float("inf"), f"probe prompt {k} continued with other tokens than the "
                                                     f"trainer's ({list(ans_t)[:8]} vs {list(ref_t)[:8]})")
        ref_lp, ans_lp = reference["logprobs"][k], answer["logprobs"][k]
        worst = max([worst, *(abs(a - b) for a, b in zip(ref_lp, ans_lp, strict=True))])
    if worst > tol:
        return ProbeVerdict(False, worst, f"the probe's log-probs differ from the trainer's by up to {worst:.3g} "
                                          f"(tolerance {tol:g})")
    return ProbeVerdict(True, worst)
