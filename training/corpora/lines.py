"""Tab-completion prompts cut from real lines: a line's first few characters up to half of it, and
the rest of the line, which is what a user was about to type. Pure standard library: the gate's
exact-continuation row, replay rollouts and the corpus's eval suite all cut lines this way.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Continuation:
    prompt: str
    rest: str  # what was actually written after the prompt on that line


def continuation_prompts(texts: Sequence[tuple[str, str]], n: int = 64, seed: int = 0,
                         min_prefix: int = 4) -> list[Continuation]:
    """`n` lines (of 8+ characters) of the texts, each cut after min_prefix..len/2 characters (fixed by
    `seed`): the prompt and the rest of the real line."""
    lines = [s for _, text in texts for line in text.splitlines() if len(s := line.strip()) >= 8]
    rng = random.Random(seed)
    picked = rng.sample(lines, min(n, len(lines)))
    out = []
    for line in picked:
        cut = rng.randint(min(min_prefix, len(line) // 2), max(min_prefix, len(line) // 2))
        out.append(Continuation(line[:cut], line[cut:]))
    return out


def heldout_bucket(path: str) -> int:
    """0..99 from the path's SHA-256: the same file is held out in every corpus that has it."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "big") % 100


def heldout_paths(paths: Sequence[str], percent: int) -> set[str]:
    """The held-out slice: files whose bucket is below `percent`; with two files or more, at least
    one held out and one kept for training (the lowest and highest buckets decide)."""
    held = {p for p in paths if heldout_bucket(p) < percent}
    ranked = sorted(paths, key=lambda p: (heldout_bucket(p), p))
    if len(paths) >= 2 and percent > 0:
        if not held:
            held = {ranked[0]}
        if len(held) == len(paths):
            held.discard(ranked[-1])
    return held
