"""Redaction at ingest: e-mail addresses, API keys and tokens, IP addresses and a project's own
patterns replaced by `[redacted:<name>]` before anything is stored or trained on.

Every pattern is a sequence of *atoms*, each one character class repeated a bounded number of
times, matched possessively (an atom takes as much as it can and never gives back), starting only
where the first atom's class begins a run (a look-behind). That is what keeps a 1 MB input linear:
a start can only be the beginning of a run of the first class, the runs are disjoint, and no atom
backtracks, so each character is examined a bounded number of times per pattern. A project's
own regex is accepted only when it parses to such a sequence (`atoms_of`); Python's `re` runs the
compiled form (possessive quantifiers, Python 3.11+), and `reference_scan`, a plain-Python matcher
of the same language that counts the characters it examines, is what the tests measure the work
with. Matches of different redactors may overlap: their spans are merged and each merged span is
replaced once (counted for every redactor that matched in it).

    .venv/bin/python -m pytest tests/feedback/test_redaction.py -q
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import re._constants as sre_c
import re._parser as sre_parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from core.errors import BadRequest

MAX_PATTERN_CHARS = 200
MAX_ATOMS = 16
MAX_REPEAT = 1000  # an atom's upper bound: "+" and "*" must be written {1,N} / {0,N}
MAX_CUSTOM = 16  # custom patterns per project
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # PostgreSQL's jsonb cannot hold them


@dataclass(frozen=True)
class Atom:
    cls: str  # a regex character class, e.g. "[A-Za-z0-9]" or "@"
    low: int
    high: int


@dataclass(frozen=True)
class Pattern:
    name: str
    atoms: tuple[Atom, ...]
    accept: Callable[[str], bool] | None = None  # a check of a candidate match (e.g. a real IP)
    boundary: str | None = None  # a match never starts right after this class (default: the first atom's)
    # A text without any of `needles` (a C-speed `in`), or in which `prefilter` finds nothing,
    # cannot match: most text skips the scan. Default needle: the longest literal run every match holds.
    needles: tuple[str, ...] = ()
    prefilter: str | None = None
    compiled: re.Pattern = field(init=False, compare=False, repr=False)
    maybe: Callable[[str], Any] | None = field(init=False, compare=False, repr=False)  # the prefilter's search

    def __post_init__(self) -> None:
        if not self.needles:
            run = _literal_run(self.atoms)
            object.__setattr__(self, "needles", (run,) if run else ())
        object.__setattr__(self, "maybe", re.compile(self.prefilter).search if self.prefilter else None)
        first = self.boundary or self.atoms[0].cls
        body = "".join(f"{a.cls}{{{a.low},{a.high}}}+" for a in self.atoms)
        object.__setattr__(self, "compiled", re.compile(f"(?<!{first}){body}"))

    def may_match(self, text: str) -> bool:
        for needle in self.needles:
            if needle in text:
                break
        else:
            if self.needles:
                return False
        return self.maybe is None or self.maybe(text) is not None


def _literal_run(atoms: tuple[Atom, ...]) -> str:
    """The longest run of single characters every match holds in a row (e.g. "ACME-"), or ""."""
    best, run = "", ""
    for atom in atoms:
        if atom.low == atom.high == 1 and _is_literal(atom.cls):
            run += _unescape(atom.cls)
            best = max(best, run, key=len)
        elif atom.low >= 1 or atom.high > 0:
            run = ""
    return best


def _is_literal(cls: str) -> bool:
    return len(_unescape(cls)) == 1 and re.escape(_unescape(cls)) == cls


def _unescape(cls: str) -> str:
    return cls[1:] if cls.startswith("\\") and len(cls) == 2 else cls


def _atoms(*parts: tuple[str, int, int]) -> tuple[Atom, ...]:
    """Atoms from (class, low, high); a plain string of several characters is one atom each."""
    out: list[Atom] = []
    for cls, low, high in parts:
        if cls.startswith("[") or cls.startswith("\\"):
            out.append(Atom(cls, low, high))
        else:
            out += [Atom(re.escape(c), 1, 1) for c in cls]
    return tuple(out)


def _domain_ok(match: str) -> bool:
    domain = match.rpartition("@")[2].rstrip(".")
    tld = domain.rpartition(".")[2]
    return "." in domain and len(tld) >= 2 and tld.isalpha()


def _ip_ok(match: str) -> bool:
    try:
        address = ipaddress.ip_address(match)
    except ValueError:
        return False
    # Loopback and "any" (127.0.0.1, ::1, 0.0.0.0) name nobody's machine, and code is full of them.
    return not (address.is_loopback or address.is_unspecified)


def _ipv6_ok(match: str) -> bool:
    # Python slices and C++/SQL casts parse as short compressed addresses ("args[1::2]", "x[::-1]",
    # "(sql)::date"): an address redacted has three colons or a group of three hex digits or more.
    colons = match.count(":")
    if colons < 2 or (colons < 3 and max(len(group) for group in match.split(":")) < 3):
        return False
    return _ip_ok(match)


_KEY = "[A-Za-z0-9_-]"
_KEY_PREFIXES = frozenset({"sk", "pk", "rk", "fw", "ghp", "gho", "ghs", "ghu", "glpat", "xoxb", "xoxp", "xoxa", "xoxr",
                           "xoxs"})
BUILTIN: dict[str, tuple[Pattern, ...]] = {
    "email": (Pattern("email", _atoms(("[A-Za-z0-9._%+-]", 1, 64), ("@", 1, 1), ("[A-Za-z0-9.-]", 3, 253)),
                      _domain_ok),),
    "api_key": (
        # Prefixed secrets (OpenAI/Stripe sk-/pk-/rk-, Flywheel fw_, GitHub ghp_/gho_/ghs_/ghu_,
        # GitLab glpat-, Slack xoxb-...): a word, a separator, then 16+ key characters.
        Pattern("api_key", _atoms(("[A-Za-z]", 2, 5), ("[-_]", 1, 1), (_KEY, 16, 512)),
                lambda m: re.split("[-_]", m, maxsplit=1)[0] in _KEY_PREFIXES, boundary=_KEY,
                needles=("-", "_"), prefilter="(?:sk|pk|rk|fw|gh[pous]|glpat|xox[bpars])[-_]"),
        Pattern("api_key", _atoms(("AKIA", 1, 1), ("[0-9A-Z]", 16, 16)), boundary="[A-Za-z0-9]"),  # AWS key ids
        # JSON Web Tokens: three base64url parts, the first an encoded '{"'.
        Pattern("api_key", _atoms(("eyJ", 1, 1), (_KEY, 8, 4096), ("[.]", 1, 1), (_KEY, 8, 4096), ("[.]", 1, 1),
                                  (_KEY, 0, 4096)), boundary=_KEY, needles=("eyJ",)),
    ),
    # An address holds "d.ddd.d" (three parts in a row); a float or a version "1.2" does not.
    "ipv4": (Pattern("ipv4", _atoms(("[0-9.]", 7, 15)), _ip_ok, needles=(".",), prefilter=r"\d\.\d{1,3}\.\d"),),
    "ipv6": (Pattern("ipv6", _atoms(("[0-9A-Fa-f:.]", 3, 45)), _ipv6_ok, boundary="[0-9A-Za-z:.]",
                     needles=(":",), prefilter=":[0-9A-Fa-f:]"),),  # "::" or a colon between groups
}


# --- a project's own patterns: parsed into atoms, or refused with the reason ----------------------


def atoms_of(pattern: str) -> tuple[Atom, ...]:
    """`pattern` as a sequence of bounded character-class atoms; BadRequest saying what to change
    when it is anything else (groups, alternation, back-references, look-arounds, anchors,
    unbounded or huge repeats)."""
    fix = ("Write a sequence of characters and classes with bounded repeats, e.g. "
           r"'ACME-[0-9]{6,10}' or '[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}'; no groups, '|', anchors or look-arounds.")
    if not isinstance(pattern, str) or not 0 < len(pattern) <= MAX_PATTERN_CHARS or _UNSTORABLE.search(pattern):
        raise BadRequest(f"a custom pattern must be 1 to {MAX_PATTERN_CHARS} characters of valid Unicode "
                         "without NUL (write \\x00 to match one)", fix)
    try:
        parsed = list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError) as exc:
        raise BadRequest(f"pattern {pattern[:60]!r} is not a regular expression ({exc})", fix) from None
    atoms = [_atom(op, av, pattern, fix) for op, av in parsed]
    if not atoms or len(atoms) > MAX_ATOMS or atoms[0].low < 1:
        raise BadRequest(f"pattern {pattern[:60]!r} must have 1 to {MAX_ATOMS} parts and start with one that "
                         "matches at least one character", fix)
    return tuple(atoms)


def _atom(op, av, pattern: str, fix: str) -> Atom:
    low = high = 1
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
        low, high, sub = av
        if high == sre_c.MAXREPEAT or high > MAX_REPEAT:
            raise BadRequest(f"pattern {pattern[:60]!r} repeats without a bound of at most {MAX_REPEAT}",
                             "Write '+' as {1,N} and '*' as {0,N} with N <= 1000. " + fix)
        if len(sub) != 1:
            raise BadRequest(f"pattern {pattern[:60]!r} repeats a group; only one character class may repeat", fix)
        op, av = list(sub)[0]
    cls = _class_text(op, av)
    if cls is None:
        raise BadRequest(f"pattern {pattern[:60]!r} uses {str(op).lower()}, which a redactor does not allow", fix)
    return Atom(cls, low, high)


_CATEGORIES = {sre_c.CATEGORY_DIGIT: r"\d", sre_c.CATEGORY_NOT_DIGIT: r"\D", sre_c.CATEGORY_SPACE: r"\s",
               sre_c.CATEGORY_NOT_SPACE: r"\S", sre_c.CATEGORY_WORD: r"\w", sre_c.CATEGORY_NOT_WORD: r"\W"}


def _class_text(op, av) -> str | None:
    if op is sre_c.LITERAL:
        return re.escape(chr(av))
    if op is sre_c.ANY:
        return r"[^\n]"
    if op is not sre_c.IN:
        return None
    parts = []
    for kind, value in av:
        if kind is sre_c.NEGATE:
            parts.append("^")
        elif kind is sre_c.LITERAL:
            parts.append(re.escape(chr(value)))
        elif kind is sre_c.RANGE:
            parts.append(f"{re.escape(chr(value[0]))}-{re.escape(chr(value[1]))}")
        elif kind is sre_c.CATEGORY and value in _CATEGORIES:
            parts.append(_CATEGORIES[value])
        else:
            return None
    return "[" + "".join(parts) + "]"


# --- the redactor ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Redactor:
    patterns: tuple[Pattern, ...]
    # One search in C that every text any pattern could match passes (the alternation of each
    # pattern's prefilter, else its needles): most text (code, prose) is returned after it, without
    # a Python-level check per pattern. None when some pattern has neither (it is always scanned).
    gate: Callable[[str], Any] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        parts: list[str] = []
        for pattern in self.patterns:
            if pattern.prefilter:
                parts.append(f"(?:{pattern.prefilter})")
            elif pattern.needles:
                parts += [re.escape(n) for n in pattern.needles]
            else:
                parts = []
                break
        object.__setattr__(self, "gate", re.compile("|".join(parts)).search if parts else None)

    @property
    def names(self) -> list[str]:
        return sorted({p.name for p in self.patterns})

    def redact(self, text: str, counts: dict[str, int]) -> str:
        """`text` with every match replaced; adds one per match to `counts[name]`."""
        if not self.patterns or not text or (self.gate is not None and self.gate(text) is None):
            return text
        spans: list[tuple[int, int, str]] = []
        for pattern in self.patterns:
            if not pattern.may_match(text):
                continue
            for m in pattern.compiled.finditer(text):
                if pattern.accept is None or pattern.accept(m.group()):
                    spans.append((m.start(), m.end(), pattern.name))
        if not spans:
            return text
        return _replace(text, spans, counts)


def _replace(text: str, spans: list[tuple[int, int, str]], counts: dict[str, int]) -> str:
    spans.sort()
    out, at, i = [], 0, 0
    while i < len(spans):
        start, end, names = spans[i][0], spans[i][1], set()
        # Overlapping matches (a key inside an e-mail address): one replacement, each one counted.
        while i < len(spans) and spans[i][0] < end or not names:
            end, name = max(end, spans[i][1]), spans[i][2]
            names.add(name)
            counts[name] = counts.get(name, 0) + 1
            i += 1
        out += [text[at:start], f"[redacted:{'+'.join(sorted(names))}]"]
        at = end
    out.append(text[at:])
    return "".join(out)


def redactor_for(names: Iterable[str], custom: Iterable[dict] = ()) -> Redactor:
    """The redactor of a data policy: built-in `names` and custom {"name", "pattern"} entries,
    each checked (BadRequest with the fix)."""
    names, custom = list(names or []), list(custom or [])
    unknown = sorted(set(names) - set(BUILTIN))
    if unknown:
        raise BadRequest(f"unknown redactors {unknown}", f"Use any of {sorted(BUILTIN)}.")
    if len(custom) > MAX_CUSTOM:
        raise BadRequest(f"{len(custom)} custom patterns; at most {MAX_CUSTOM} are allowed", "Merge or drop some.")
    patterns = [p for n in dict.fromkeys(names) for p in BUILTIN[n]]  # each named once
    for entry in custom:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(f"custom pattern name {str(name)[:40]!r} is not valid",
                             "Name it with 1 to 32 lowercase letters, digits or '_', starting with a letter.")
        patterns.append(Pattern(name, atoms_of(entry.get("pattern"))))
    return Redactor(tuple(patterns))


def redactor_of_policy(names: Iterable[str], custom: Iterable[dict] = ()) -> Redactor:
    """`redactor_for` a stored policy, built once per distinct policy (a Redactor is immutable):
    ingest asks for it on every batch."""
    return _redactor_cached(tuple(names or ()), json.dumps(list(custom or ()), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _redactor_cached(names: tuple[str, ...], custom: str) -> Redactor:
    return redactor_for(names, json.loads(custom))


# --- the reference matcher (for measuring work) ---------------------------------------------------


def reference_scan(atoms: tuple[Atom, ...], text: str, boundary: str | None = None
                   ) -> tuple[list[tuple[int, int]], int]:
    """(spans, characters examined) of the atom sequence over `text`, with the semantics of
    `Pattern.compiled`: a start only where the first class begins a run, possessive atoms, the
    leftmost match, then on from its end. Plain Python; the tests count its work."""
    tests = [re.compile(a.cls).fullmatch for a in atoms]
    after = re.compile(boundary).fullmatch if boundary else tests[0]
    spans, work, i, n = [], 0, 0, len(text)
    while i < n:
        work += 1
        if not tests[0](text[i]) or (i > 0 and after(text[i - 1])):
            i += 1
            continue
        at, ok = i, True
        for atom, test in zip(atoms, tests, strict=True):
            taken = 0
            while taken < atom.high and at < n and test(text[at]):
                work, at, taken = work + 1, at + 1, taken + 1
            if taken < atom.low:
                ok = False
                break
        if ok and at > i:
            spans.append((i, at))
            i = at
        else:
            i += 1
    return spans, work


# --- events ----------------------------------------------------------------------------------------

# Fields that are identifiers or choices, never free text (ids, signals, versions, roles).
_STRUCTURAL = frozenset({"type", "id", "trajectory_id", "signal", "user", "occurred_at", "policy_version", "source",
                         "task", "tags", "consent", "group", "value", "step", "aspect_labels"})
_SAMPLED = ("token_ids", "logprobs", "routing", "prompt_token_ids", "tokens")  # they encode the text
MAX_WALK_DEPTH = 40  # deeper than ingest accepts (32): such an event is refused by parse_event anyway


def redact_event(raw: Any, redactor: Redactor, counts: dict[str, int]) -> Any:
    """One raw ingest event with its free text redacted (prompt, steps' content and tool calls,
    extra fields): a copy when anything changed, else `raw` itself (never changed in place). A
    step whose text changed loses its sampled token ids, log-probs and routing (they encode the
    redacted text; the trainer re-tokenises the turn), and a redacted prompt drops the recorded
    prompt token ids. Nothing is copied until something changes: most events cost a walk."""
    if not isinstance(raw, dict) or not redactor.patterns:
        return raw
    changed: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _STRUCTURAL and key != "steps":
            new = _walk(value, redactor, counts, 0)
            if new is not value:
                changed[key] = new
    steps = raw.get("steps")
    new_steps = _each(steps, _step, redactor, counts) if isinstance(steps, list) else steps
    if not changed and new_steps is steps:
        return raw
    out = {**raw, **changed}
    if "prompt" in changed:
        out.pop("prompt_token_ids", None)
        new_steps = [{k: v for k, v in s.items() if k != "prompt_token_ids"} if isinstance(s, dict) else s
                     for s in new_steps]
    if steps is not None:
        out["steps"] = new_steps
    return out


def _each(items: list, redact_one: Callable[..., Any], *args: Any) -> list:
    """`items` with `redact_one(item, *args)` applied: the same list when no item changed."""
    out = None
    for i, item in enumerate(items):
        new = redact_one(item, *args)
        if new is not item:
            if out is None:
                out = list(items)
            out[i] = new
    return items if out is None else out


def _step(raw: Any, redactor: Redactor, counts: dict[str, int]) -> Any:
    if not isinstance(raw, dict):
        return raw
    changed: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _SAMPLED and key != "role":
            new = _walk(value, redactor, counts, 0)
            if new is not value:
                changed[key] = new
    if not changed:
        return raw
    out = {**raw, **changed}
    if "content" in changed or "tool_calls" in changed:
        for key in _SAMPLED:
            out.pop(key, None)
    return out


def _walk(value: Any, redactor: Redactor, counts: dict[str, int], depth: int) -> Any:
    """`value` with its strings redacted: the same object when nothing in it changed."""
    if isinstance(value, str):
        return redactor.redact(value, counts)
    if depth > MAX_WALK_DEPTH:
        return value
    if isinstance(value, list):
        return _each(value, _walk, redactor, counts, depth + 1)
    if isinstance(value, dict):  # a message's role is a name, not text
        changed = {k: new for k, v in value.items() if k != "role"
                   and (new := _walk(v, redactor, counts, depth + 1)) is not v}
        return {**value, **changed} if changed else value
    return value
