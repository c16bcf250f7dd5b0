"""Simulated users for the demo: they ask the serving process for completions and react to them.

A population has a *taste* (which suggestions it accepts), a *code base* (the code its users are
writing) and a *noise* rate (random clicks). The default taste, `intent`, is a tab-completion
user typing a real line of a code base the base policy never saw (django's source, or
`--corpus`): the prompt is the file's preceding lines plus the line's first characters, and the
user accepts the suggestion's first line when it is what they were about to type, part of it when
only a prefix is right (`accept` with `value` = the characters kept), and rejects the rest
(training.rewards.usefulness.intent_reaction). The line tastes in TASTES (`compiles`,
`one-statement`, the gameable `short-compiles`) judge a statement's start with no context. An
empty suggestion is not shown to a user, so it gets no click (silence). Held-out files (fixed by
a hash of their path, the corpora's rule) are never sent by users: they are what the learning bench
evaluates on, and what a corpus of the same folder holds out of mid-training.
Now and then a user says happy/sad, labels the suggestion's aspects, or sends a dissatisfied
follow-up. Feedback goes through the signed webhook like a real product's; the completions
through the OpenAI-compatible endpoint. No Django import.
"""

from __future__ import annotations

import importlib.util
import random
import sysconfig
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

from feedback.client import FlywheelClient
from training.corpora.lines import heldout_paths
from training.gate.naturalness import inventing_share, top_share
from training.rewards.usefulness import accepted_chars, intent_reaction, known_names


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
INTENT = "intent"  # accepts what the user was about to type (needs the rest of their line)
TASTES: dict[str, Taste] = {"compiles": _compiles, "one-statement": _one_statement,
                            "short-compiles": _short_and_compiles}
POPULATIONS = (INTENT, *TASTES)  # every taste a population can have; the first is the default


def shown(completion: str) -> bool:
    """An empty (or whitespace) suggestion is not shown to the user."""
    return completion.strip() != ""


def likes(taste: str, prompt: str, completion: str, intended: str = "") -> bool:
    """The population's judgement without click noise (what a held-out evaluation measures); the
    intent taste also needs `intended`, the rest of the line the user was typing."""
    if taste == INTENT:
        return intent_reaction(completion, intended).signal == "accept"
    return shown(completion) and TASTES[taste](prompt, completion)


def react(prompt: str, completion: str, rng: random.Random, taste: str = INTENT,
          noise: float = 0.05, intended: str = "") -> list[Reaction]:
    """What one simulated user does after seeing `completion` for `prompt`: nothing when it was
    not shown; otherwise accept/reject by taste, a random click with probability `noise`. An
    intent user's accept carries the characters kept (`value`; a random accept keeps the first
    line whole)."""
    if not shown(completion):
        return []
    good = likes(taste, prompt, completion, intended)
    accepted = rng.random() < 0.5 if rng.random() < noise else good
    reactions = [Reaction("accept" if accepted else "reject")]
    if taste == INTENT and accepted:
        kept = intent_reaction(completion, intended).value if good else len(completion.split("\n", 1)[0].rstrip())
        reactions[0].value = float(kept)
    if rng.random() < 0.2:
        reactions.append(Reaction("happy" if good else "sad"))
    if not good and rng.random() < 0.1:
        reactions.append(Reaction("followup_dissatisfied"))
    return reactions


@dataclass(frozen=True)
class UserPrompt:
    """One request: what is sent (`prompt`), what the user was about to type (`intended`, the rest
    of their line), and the file it came from."""

    prompt: str
    intended: str
    path: str = ""


@dataclass(frozen=True)
class CodeFile:
    path: str  # relative to the code base's root
    lines: tuple[str, ...]


@dataclass(frozen=True)
class CodeBase:
    """A folder of Python files: the ones users write in, the held-out ones, and every name it has."""

    root: str
    files: tuple[CodeFile, ...]
    held_out_percent: int = 10

    @cached_property
    def held_out(self) -> frozenset[str]:
        """The corpora's own rule (training.corpora.lines.heldout_paths, by path hash): a corpus of
        this folder holds out the same files, so mid-training on it never sees what users are
        evaluated on."""
        return frozenset(heldout_paths([f.path for f in self.files], self.held_out_percent))

    def is_held_out(self, path: str) -> bool:
        return path in self.held_out

    def users_files(self) -> list[CodeFile]:
        return [f for f in self.files if not self.is_held_out(f.path)]

    def held_out_files(self) -> list[CodeFile]:
        return [f for f in self.files if self.is_held_out(f.path)]

    @cached_property
    def known(self) -> frozenset[str]:
        """Every name of the code base and of the language: what a suggestion may use."""
        return known_names("\n".join(f.lines) for f in self.files)


def django_source() -> Path:
    """The held-out code base by default: django's source as installed (never in pretraining,
    which reads the standard library); found without importing Django."""
    spec = importlib.util.find_spec("django")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("django is not installed here: pass --corpus DIR (a folder of *.py files)")
    return Path(next(iter(spec.submodule_search_locations)))


def stdlib_source() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_base(folder: str | Path, held_out_percent: int = 10) -> CodeBase:
    """The *.py files under `folder` (tests and site-packages skipped for the standard library),
    in a fixed (sorted) order."""
    root = Path(folder)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "test" in rel.parts or "tests" in rel.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            files.append(CodeFile(rel.as_posix(), tuple(text.splitlines())))
    if not files:
        raise ValueError(f"no Python files under {folder}: pass a folder of *.py files")
    return CodeBase(str(root), tuple(files), held_out_percent)


CONTEXT_LINES = 6  # a tab-completion prompt carries the file's preceding lines ...
CONTEXT_CHARS = 360  # ... at most this much of them (the policy's context is short)


def intent_prompt(lines: Sequence[str], index: int, cut: int) -> UserPrompt | None:
    """The user has typed line `index` up to `cut` characters past its indentation: the prompt is
    the preceding lines of the file and that start; what is left of the line is `intended`."""
    line = lines[index].rstrip()
    indent = len(line) - len(line.lstrip())
    if len(line) - indent < 12 or cut > len(line) - indent - 3:
        return None
    context = "\n".join(lines[max(0, index - CONTEXT_LINES):index])[-CONTEXT_CHARS:]
    head = line[:indent + cut]
    return UserPrompt((context + "\n" if context else "") + head, line[indent + cut:])


def line_prompt(line: str, cut: int) -> UserPrompt | None:
    """A statement's start with no context, its indentation dropped (an indented prefix alone
    never compiles, whatever the completion: the line tastes could accept nothing)."""
    text = line.strip()
    if len(text) < max(8, cut):
        return None
    return UserPrompt(text[:cut], text[cut:])


def _request(files: Sequence[CodeFile], taste: str, rng: random.Random) -> UserPrompt | None:
    """A random line of a random file, cut where a user of the taste would ask (None: the line is
    too short to ask about)."""
    file = rng.choice(files)
    index = rng.randrange(len(file.lines))
    if taste == INTENT:
        p = intent_prompt(file.lines, index, rng.randint(2, 20))
    else:
        p = line_prompt(file.lines[index], rng.randint(8, 24))
    return None if p is None else UserPrompt(p.prompt, p.intended, file.path)


def user_prompts(source: CodeBase | Sequence[str], taste: str, rng: random.Random) -> Iterator[UserPrompt]:
    """The requests of one user, forever. From a code base: its files minus the held-out ones
    (intent: a line in its file's context; line tastes: a statement's start). From plain lines
    (an older caller): statement starts."""
    if not isinstance(source, CodeBase):
        while True:
            if (p := line_prompt(rng.choice(source), rng.randint(8, 24))) is not None:
                yield p
    files = [f for f in source.users_files() if f.lines]
    while True:
        if (p := _request(files, taste, rng)) is not None:
            yield p


def held_out_prompts(code: CodeBase, taste: str, n: int, seed: int = 11) -> list[UserPrompt]:
    """`n` requests from the held-out files only (users never send them), the same for a seed."""
    rng = random.Random(seed)
    files = [f for f in code.held_out_files() if f.lines]
    out: list[UserPrompt] = []
    for _ in range(n * 50 if files else 0):
        if len(out) == n:
            break
        if (p := _request(files, taste, rng)) is not None:
            out.append(p)
    return out


def population_metrics(taste: str, requests: Sequence[UserPrompt], suggestions: Sequence[str],
                       known: frozenset[str]) -> dict[str, float]:
    """What a population's users got from one suggestion per request, without click noise:
    accepted characters per request (the utility: what they did not have to type), the accept
    rate by the population's taste, silence, the share of shown suggestions that invent a name and
    the most common suggestion's share of the requests (the gate's naturalness figures,
    training.gate.naturalness), and the characters matching what the user was about to type (any
    length, the first line's common prefix)."""
    n = max(len(requests), 1)
    pairs = list(zip(requests, suggestions, strict=True))
    visible = [(r, s) for r, s in pairs if shown(s)]
    return {
        "accepted_chars": sum(accepted_chars(s, r.intended) for r, s in visible) / n,
        "accept_rate": sum(likes(taste, r.prompt, s, r.intended) for r, s in visible) / n,
        "silent_rate": 1 - len(visible) / n,
        "invented_share": inventing_share([(s, r.prompt) for r, s in pairs], known),
        "top_suggestion_share": top_share([[s] for s in suggestions]),
        "matched_chars": sum(accepted_chars(s, r.intended, min_chars=1) for r, s in visible) / n,
    }


@dataclass
class Budget:
    """The completions the users may still ask for (None: no limit), shared by their threads."""

    limit: int | None
    served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        with self.lock:
            if self.limit is not None and self.served >= self.limit:
                return False
            self.served += 1
            return True

    def unclaim(self) -> None:
        with self.lock:
            self.served -= 1


@dataclass(frozen=True)
class UserSettings:
    """What every simulated user does: the model it asks, how long it pauses, its taste."""

    model: str
    serve_key: str
    pause_s: float = 0.5
    max_tokens: int = 16
    taste: str = INTENT
    noise: float = 0.05


def user_keys(serve_key: str | Sequence[str], users: int) -> list[str]:
    """The key each of `users` users asks with: user i takes key i modulo the keys given."""
    keys = [serve_key] if isinstance(serve_key, str) else list(serve_key)
    if not keys:
        raise ValueError("simulated users need at least one serve key")
    return [keys[i % len(keys)] for i in range(max(users, 1))]


def run_users(
    serving_url: str,
    sender: FlywheelClient,
    model: str,
    source: CodeBase | Sequence[str],
    *,
    serve_key: str | Sequence[str],
    requests: int | None = None,
    pause_s: float = 0.5,
    max_tokens: int = 16,
    seed: int = 0,
    users: int = 4,
    taste: str = INTENT,
    noise: float = 0.05,
) -> int:
    """Asks for completions and sends reactions; returns the number of completions served.

    `source`: the code base the users write in (or, for a line taste, plain lines).
    `users` simulated users work concurrently (the server batches their requests); they ask with
    `serve_key`, an API key of scope `serve`, or one key each from a list (user i takes key i
    modulo their number): serving limits each key's rate, as it would a client's."""
    budget = Budget(requests)
    settings = [UserSettings(model, key, pause_s, max_tokens, taste, noise) for key in user_keys(serve_key, users)]
    if users <= 1:
        user_run(serving_url, sender, source, settings[0], budget, random.Random(seed))
        return budget.served
    threads = [threading.Thread(target=user_run, args=(serving_url, sender, source, settings[i], budget,
                                                       random.Random(seed + 1000 * i)), daemon=True)
               for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return budget.served


def user_run(serving_url: str, sender: FlywheelClient, source: CodeBase | Sequence[str], settings: UserSettings,
             budget: Budget, rng: random.Random) -> None:
    """One simulated user: a request, its completion, the user's reactions, a pause; until the
    budget is spent. A completion that failed is given back to the budget and asked again later."""
    headers = {"Authorization": f"Bearer {settings.serve_key}"}
    with httpx.Client(base_url=serving_url, timeout=120, headers=headers) as http:
        for request in user_prompts(source, settings.taste, rng):
            if not budget.claim():
                break
            choice = _complete(http, settings.model, request.prompt, settings.max_tokens)
            if choice is None:
                budget.unclaim()
                time.sleep(2)
                continue
            events = _feedback_events(choice, request, rng, settings.taste, settings.noise)
            if events:
                sender.send(events)
            time.sleep(settings.pause_s)


def _complete(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> dict[str, Any] | None:
    try:
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                               "metadata": {"task": "tab-completion"}})
    except httpx.TransportError:
        return None
    return r.json()["choices"][0] if r.status_code == 200 else None


def _feedback_events(choice: dict[str, Any], request: UserPrompt, rng: random.Random, taste: str,
                     noise: float) -> list[dict[str, Any]]:
    user = f"sim-{rng.randint(1, 50)}"
    events = [
        {"type": "feedback", "id": f"sim-{uuid.uuid4().hex}", "trajectory_id": choice["trajectory_id"],
         "signal": r.signal, "value": r.value, "user": user}
        for r in react(request.prompt, choice["text"], rng, taste, noise, request.intended)
    ]
    if events and rng.random() < LABEL_SHARE:
        events[0]["aspect_labels"] = aspect_labels(request.prompt, choice["text"])
    return events


LABEL_SHARE = 0.1  # one suggestion in ten also gets the user's aspect labels (the rubric page)


def aspect_labels(prompt: str, completion: str) -> dict[str, float]:
    """What a user would say of the suggestion's style and concision, in [0, 1]: the human side of
    the rubric page's judge-vs-human agreement. Style: the line being typed and the suggestion read
    as code (they compile, or the suggestion's first line completes a statement or opens a block)
    in lines of at most 79 characters; the file's preceding lines are not part of the judgement."""
    text = completion.strip()
    typed = prompt.rsplit("\n", 1)[-1].lstrip()
    statement = (typed + completion.split("\n", 1)[0]).strip()
    code = compiles(typed + completion) or _reads_as_code(statement)
    lines = [line for line in (typed + completion).splitlines() if line.strip()]
    style = 1.0 if code and all(len(line) <= 79 for line in lines) else 0.3
    concision = 1.0 if len(text) <= 24 else 0.6 if len(text) <= 48 else 0.2
    return {"style": style, "concision": concision}


def _reads_as_code(statement: str) -> bool:
    """A statement that compiles on its own, inside a function (return, yield), or as a block's
    opening line (a trailing colon)."""
    body = statement + " pass" if statement.endswith(":") else statement
    return compiles(body) or compiles("async def _():\n " + body)


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
