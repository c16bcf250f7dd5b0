"""What a tab-completion suggestion is worth to the person who sees it, and whether it invents code.

Pure standard library (no Django, no torch): the simulated users (webapp/demo), the corpus replay
rollouts' verifiable reward, the gate's naturalness rows and the benches all apply these same rules.

- `accepted_chars(suggestion, intended)`: the characters of the suggestion's first line that match
  what the user was about to type (the rest of their line): what they did not have to type.
- `intent_reaction(...)`: accept (the whole first line is right), partial (only a prefix is), or
  reject; an empty suggestion is not shown.
- `invented_names(...)`: identifiers of a suggestion that exist neither in the project's code base
  nor in the language (keywords, builtins, their attributes, standard-library module names).
"""

from __future__ import annotations

import builtins
import keyword
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*")
MIN_ACCEPT_CHARS = 3  # a shorter match is not worth pressing Tab for


def first_line(text: str) -> str:
    """The part of a suggestion a tab-completion user sees inline: up to its first line break."""
    return text.split("\n", 1)[0]


def accepted_chars(suggestion: str, intended: str, min_chars: int = MIN_ACCEPT_CHARS) -> int:
    """Length of the longest common prefix of the suggestion's first line and the intended rest of
    the line, 0 below `min_chars` (trailing whitespace of the suggestion never counts)."""
    shown_line, target = first_line(suggestion).rstrip(), first_line(intended)
    n = 0
    for a, b in zip(shown_line, target, strict=False):
        if a != b:
            break
        n += 1
    return n if n >= min_chars else 0


def kept_share(suggestion: str, intended: str, min_chars: int = MIN_ACCEPT_CHARS) -> float:
    """`accepted_chars` over the length of the line the user was about to type, in [0, 1] (0 when
    nothing was intended): the reward of replay rollouts and the `intent_match` check."""
    target = first_line(intended)
    return accepted_chars(suggestion, intended, min_chars) / len(target) if target else 0.0


@dataclass(frozen=True)
class IntentReaction:
    """`signal` is accept | reject | "" (not shown); `value` the accepted characters (accept only)."""

    signal: str
    value: int = 0
    full: bool = False


def intent_reaction(suggestion: str, intended: str, min_chars: int = MIN_ACCEPT_CHARS) -> IntentReaction:
    """A tab-completion user who accepts what they were about to type: the whole first line when it
    is all right, a prefix of it (partial accept, `value` = kept characters) when only its start is."""
    line = first_line(suggestion).rstrip()
    if not line.strip():
        return IntentReaction("")
    kept = accepted_chars(suggestion, intended, min_chars)
    if kept == 0:
        return IntentReaction("reject")
    return IntentReaction("accept", kept, full=kept == len(line))


@lru_cache(maxsize=1)
def language_names() -> frozenset[str]:
    """Python's own names: keywords, builtins and their attributes, standard-library modules."""
    names: set[str] = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))
    names |= set(sys.stdlib_module_names)
    for obj in vars(builtins).values():
        if isinstance(obj, type):
            names |= set(dir(obj))
    names |= {"self", "cls", "args", "kwargs"}
    return frozenset(names)


def names_in(code: str) -> list[str]:
    """Identifiers of a piece of code, in order (string contents included: a cheap, total rule)."""
    return IDENTIFIER.findall(code)


def known_names(texts: Iterable[str]) -> frozenset[str]:
    """Every identifier of a code base, plus the language's: what a suggestion may use."""
    names: set[str] = set()
    for text in texts:
        names.update(names_in(text))
    return frozenset(names) | language_names()


def written_names(suggestion: str, prompt: str) -> list[tuple[int, str]]:
    """The identifiers the suggestion writes, as (end offset, name) in prompt-head + suggestion: the
    first one is read together with the prompt's unfinished identifier (the suggestion continues it)."""
    head = re.search(r"[A-Za-z0-9_]*$", prompt).group(0)
    return [(m.end() - len(head), m.group(0)) for m in IDENTIFIER.finditer(head + suggestion) if m.end() > len(head)]


def invented_names(suggestion: str, prompt: str, known: frozenset[str], truncated: bool = True) -> list[str]:
    """Identifiers the suggestion writes (`written_names`) that `known` lacks; when `truncated`, a
    last identifier cut at the suggestion's end only has to be the start of a known name."""
    invented = []
    for end, name in written_names(suggestion, prompt):
        if name in known:
            continue
        if truncated and end == len(suggestion) and _is_prefix_of_known(name, known):
            continue
        invented.append(name)
    return invented


def _is_prefix_of_known(name: str, known: frozenset[str]) -> bool:
    return any(k.startswith(name) for k in known)


def invents(suggestion: str, prompt: str, known: frozenset[str]) -> bool:
    """True when the suggestion writes at least one name that exists nowhere."""
    return bool(invented_names(suggestion, prompt, known))
