"""Simulated users for the demo: they ask the serving process for completions and react to them.

A user accepts a tab completion when prompt + completion compiles as Python (a taste the policy
can learn), rejects it otherwise, and now and then says happy/sad or sends a dissatisfied
follow-up. Feedback goes through the signed webhook like a real product's. No Django import.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from feedback.client import FlywheelClient


@dataclass
class Reaction:
    signal: str
    value: float | None = None


def compiles(source: str) -> bool:
    try:
        compile(source, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def react(prompt: str, completion: str, rng: random.Random) -> list[Reaction]:
    """What one simulated user does after seeing `completion` for `prompt`."""
    good = compiles(prompt + completion) and completion.strip() != ""
    reactions = [Reaction("accept" if (good and rng.random() < 0.9) or rng.random() < 0.05 else "reject")]
    if rng.random() < 0.2:
        reactions.append(Reaction("happy" if good else "sad"))
    if not good and rng.random() < 0.1:
        reactions.append(Reaction("followup_dissatisfied"))
    return reactions


def prompts_from(lines: Sequence[str], rng: random.Random, prefix_chars: int = 24) -> Iterator[str]:
    """The start of a statement: a line's first 8..prefix_chars characters, its indentation dropped
    (an indented prefix alone never compiles, whatever the completion: users could accept nothing)."""
    while True:
        line = rng.choice(lines).strip()
        yield line[: rng.randint(8, prefix_chars)]


def run_users(
    serving_url: str,
    sender: FlywheelClient,
    model: str,
    lines: Sequence[str],
    *,
    requests: int | None = None,
    pause_s: float = 0.5,
    max_tokens: int = 16,
    seed: int = 0,
    users: int = 4,
) -> int:
    """Asks for completions and sends reactions; returns the number of completions served.

    `users` simulated users work concurrently (the server batches their requests)."""
    served = [0]
    lock = threading.Lock()

    def claim() -> bool:
        with lock:
            if requests is not None and served[0] >= requests:
                return False
            served[0] += 1
            return True

    def unclaim() -> None:
        with lock:
            served[0] -= 1

    def user(index: int) -> None:
        rng = random.Random(seed + 1000 * index)
        with httpx.Client(base_url=serving_url, timeout=120) as http:
            for prompt in prompts_from(lines, rng):
                if not claim():
                    break
                choice = _complete(http, model, prompt, max_tokens)
                if choice is None:
                    unclaim()
                    time.sleep(2)
                    continue
                sender.send(_feedback_events(choice, prompt, rng))
                time.sleep(pause_s)

    if users <= 1:
        user(0)
        return served[0]
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return served[0]


def _complete(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> dict[str, Any] | None:
    try:
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "metadata": {"task": "tab-completion"}})
    except httpx.TransportError:
        return None
    return r.json()["choices"][0] if r.status_code == 200 else None


def _feedback_events(choice: dict[str, Any], prompt: str, rng: random.Random) -> list[dict[str, Any]]:
    user = f"sim-{rng.randint(1, 50)}"
    return [
        {"type": "feedback", "id": f"sim-{uuid.uuid4().hex}", "trajectory_id": choice["trajectory_id"],
         "signal": r.signal, "value": r.value, "user": user}
        for r in react(prompt, choice["text"], rng)
    ]
