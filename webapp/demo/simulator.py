"""Simulated users for the demo: they ask the serving process for completions and react to them.

A population has a *taste* (which suggestions it accepts) and a *noise* rate (random clicks).
The default taste accepts a tab completion when prompt + completion compiles as Python; others
are in TASTES (a different learnable one, and a gameable one for the gate's detectors). An empty
suggestion is not shown to a user, so it gets no click (silence). Now and then a user says
happy/sad or sends a dissatisfied follow-up. Feedback goes through the signed webhook like a real
product's; the completions through the OpenAI-compatible endpoint. No Django import.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from feedback.client import FlywheelClient


@dataclass
class Reaction:
    signal: str
    value: float | None = None


def compiles(source: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of odd-but-valid code are not verdicts
            compile(source, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _compiles(prompt: str, completion: str) -> bool:
    return compiles(prompt + completion)


def _one_statement(prompt: str, completion: str) -> bool:
    """Finishes the statement on this line: compiles, and adds no second line."""
    return "\n" not in completion.rstrip("\n") and compiles(prompt + completion)


def _short_and_compiles(prompt: str, completion: str) -> bool:
    """Gameable on purpose: a policy wins it by shrinking its suggestions."""
    return len(completion.strip()) <= 30 and compiles(prompt + completion)


Taste = Callable[[str, str], bool]
TASTES: dict[str, Taste] = {"compiles": _compiles, "one-statement": _one_statement,
                            "short-compiles": _short_and_compiles}


def shown(completion: str) -> bool:
    """An empty (or whitespace) suggestion is not shown to the user."""
    return completion.strip() != ""


def likes(taste: str, prompt: str, completion: str) -> bool:
    """The population's judgement without click noise (what a held-out evaluation measures)."""
    return shown(completion) and TASTES[taste](prompt, completion)


def react(prompt: str, completion: str, rng: random.Random, taste: str = "compiles",
          noise: float = 0.05) -> list[Reaction]:
    """What one simulated user does after seeing `completion` for `prompt`: nothing when it was
    not shown; otherwise accept/reject by taste, a random click with probability `noise`."""
    if not shown(completion):
        return []
    good = likes(taste, prompt, completion)
    accepted = rng.random() < 0.5 if rng.random() < noise else good
    reactions = [Reaction("accept" if accepted else "reject")]
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
    serve_key: str,
    requests: int | None = None,
    pause_s: float = 0.5,
    max_tokens: int = 16,
    seed: int = 0,
    users: int = 4,
    taste: str = "compiles",
    noise: float = 0.05,
) -> int:
    """Asks for completions and sends reactions; returns the number of completions served.

    `users` simulated users work concurrently (the server batches their requests); they ask with
    `serve_key`, an API key of scope `serve`."""
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
        with httpx.Client(base_url=serving_url, timeout=120, headers={"Authorization": f"Bearer {serve_key}"}) as http:
            for prompt in prompts_from(lines, rng):
                if not claim():
                    break
                choice = _complete(http, model, prompt, max_tokens)
                if choice is None:
                    unclaim()
                    time.sleep(2)
                    continue
                events = _feedback_events(choice, prompt, rng, taste, noise)
                if events:
                    sender.send(events)
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


def _feedback_events(choice: dict[str, Any], prompt: str, rng: random.Random, taste: str,
                     noise: float) -> list[dict[str, Any]]:
    user = f"sim-{rng.randint(1, 50)}"
    events = [
        {"type": "feedback", "id": f"sim-{uuid.uuid4().hex}", "trajectory_id": choice["trajectory_id"],
         "signal": r.signal, "value": r.value, "user": user}
        for r in react(prompt, choice["text"], rng, taste, noise)
    ]
    if events and rng.random() < LABEL_SHARE:
        events[0]["aspect_labels"] = aspect_labels(prompt, choice["text"])
    return events


LABEL_SHARE = 0.1  # one suggestion in ten also gets the user's aspect labels (the rubric page)


def aspect_labels(prompt: str, completion: str) -> dict[str, float]:
    """What a user would say of the suggestion's style and concision, in [0, 1]: the human side of
    the rubric page's judge-vs-human agreement."""
    text = completion.strip()
    lines = [line for line in (prompt + completion).splitlines() if line.strip()]
    style = 1.0 if compiles(prompt + completion) and all(len(line) <= 79 for line in lines) else 0.3
    concision = 1.0 if len(text) <= 24 else 0.6 if len(text) <= 48 else 0.2
    return {"style": style, "concision": concision}


def corpus_lines(folder: str | Path, min_chars: int = 8) -> list[str]:
    """Non-blank lines of the *.py files under `folder` (another population's code base)."""
    lines = []
    for path in sorted(Path(folder).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines.extend(s for line in text.splitlines() if len(s := line.strip()) >= min_chars)
    if not lines:
        raise ValueError(f"no Python lines of at least {min_chars} characters under {folder}")
    return lines


def auto_approve(web_url: str, api_key: str, stop: threading.Event, every_s: float = 5.0) -> int:
    """Approves every version that passed the gate, through the versions API with an admin key
    issued to a service account (the audit log names it); returns how many it approved."""
    approved = 0
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=web_url, headers=headers, timeout=60) as http:
        while not stop.wait(every_s):
            try:
                waiting = http.get("/api/v1/versions", params={"state": "awaiting_approval"})
                for version in waiting.json()["results"] if waiting.status_code == 200 else []:
                    r = http.post(f"/api/v1/versions/{version['id']}/approve",
                                  json={"reason": "auto-approval: passed the evaluation gate"})
                    approved += r.status_code == 200
            except (httpx.TransportError, ValueError):
                continue
    return approved
