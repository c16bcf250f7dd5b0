"""Offline clicks of intent-taste users (they accept what they were about to type), for fitting and
measuring the users' reward models without a running deployment.

Each case is a code line cut at a random point: the prompt is the lines before it plus the line's
start, the intended text the rest of the line. Its suggestion is, by a fixed mix: the true rest
(cut at a random length: right), a true prefix with another line's tail (partially right), another
line's rest (wrong) or the policy's own sampled continuation. The click is
`training.rewards.usefulness.intent_reaction` — accept (graded by the accepted characters, as the
spec's `chars` grade reads it), partial accept or reject; a suggestion it would not show is left out.

A right and a wrong suggestion are both real code, so the suggestion alone does not say which it
is: only a model that reads it after its prompt can (tests/training/rewards/test_reward_model.py,
bench/reward_model.py).

Pure torch and standard library; `encode` and `decode` are the policy's tokenizer's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from training.rewards.reward_model import Labelled
from training.rewards.spec import Grade
from training.rewards.usefulness import first_line, intent_reaction

MIX = {"right": 0.3, "partial": 0.2, "wrong": 0.4, "sampled": 0.1}
SCALE = 40  # the chars grade: accepted characters that earn a full accept (DEFAULT-like spec)
SAMPLE_TOKENS = 12


@dataclass(frozen=True)
class Case:
    prompt: str
    intended: str  # the rest of the line the user was about to type


def code_cases(lines: Sequence[str], n: int, seed: int, context: int = 2) -> list[Case]:
    """`n` cases from consecutive `lines` of code (each with `context` lines before it)."""
    rng = random.Random(seed)
    usable = [i for i in range(context, len(lines)) if len(lines[i].strip()) >= 12]
    out = []
    for i in rng.sample(usable, min(n, len(usable))):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        cut = rng.randint(indent + 2, len(line) - 6)
        out.append(Case("\n".join([*lines[i - context:i], line[:cut]]), line[cut:]))
    return out


def _suggestion(kind: str, case: Case, other: Case, rng: random.Random) -> str:
    """Right and wrong are cut alike (another line's rest, at a random length): their shape is the same."""
    rest = case.intended if kind == "right" else other.intended
    text = rest[:rng.randint(min(6, len(rest)), len(rest))]
    if kind == "partial":
        keep = rng.randint(3, max(3, len(case.intended) - 3))
        return case.intended[:keep] + text[keep:]
    return text


@torch.no_grad()
def sample_continuations(policy: torch.nn.Module, prompts: Sequence[list[int]], seed: int,
                         max_tokens: int = SAMPLE_TOKENS, eos_id: int | None = None) -> list[list[int]]:
    """Temperature-1 samples of `max_tokens` ids per prompt (full recompute: small batches, few steps)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # (1, T)
        for _ in range(max_tokens):
            logits = policy(input_ids=ids, use_cache=False).logits[0, -1].float()  # (V,)
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)  # (1,)
            if eos_id is not None and int(nxt) == eos_id:
                break
            ids = torch.cat([ids, nxt[None]], 1)
        out.append(ids[0, len(prompt):].tolist())
    return out


def intent_clicks(cases: Sequence[Case], policy: torch.nn.Module, encode: Callable[[str], list[int]],
                  decode: Callable[[list[int]], str], seed: int, mix: dict[str, float] = MIX,
                  eos_id: int | None = None) -> list[Labelled]:
    """One labelled suggestion per case (in order), shown ones only."""
    rng = random.Random(seed)
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=len(cases))
    sampled_at = [i for i, k in enumerate(kinds) if k == "sampled"]
    samples = sample_continuations(policy, [encode(cases[i].prompt)[-96:] for i in sampled_at], seed, eos_id=eos_id)
    texts = {i: first_line(decode(ids)) for i, ids in zip(sampled_at, samples, strict=True)}
    grade = Grade("chars", SCALE)
    out = []
    for i, (case, kind) in enumerate(zip(cases, kinds, strict=True)):
        other = cases[(i + 1 + rng.randrange(len(cases) - 1)) % len(cases)]
        text = texts[i] if kind == "sampled" else _suggestion(kind, case, other, rng)
        reaction = intent_reaction(text, case.intended)
        if not reaction.signal:
            continue
        label = grade.factor(reaction.value) if reaction.signal == "accept" else 0.0
        out.append(Labelled(case.prompt, text, {}, encode(text), label, prompt_ids=encode(case.prompt)))
    return out
