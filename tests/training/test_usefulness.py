"""The rules that say what a suggestion is worth to its user (training/rewards/usefulness.py)."""

from training.rewards.usefulness import (
    accepted_chars,
    intent_reaction,
    invented_names,
    known_names,
    language_names,
)


def test_the_accepted_characters_are_the_first_lines_common_prefix_with_what_was_intended():
    assert accepted_chars("(a, b)\n    return", "(a, b):") == 6
    assert accepted_chars("(a, c)", "(a, b):") == 4
    assert accepted_chars("(x", "(a, b):") == 0  # below the minimum: not worth a Tab
    assert accepted_chars("   ", "   x") == 0


def test_a_user_accepts_the_whole_line_part_of_it_or_rejects_it():
    assert intent_reaction("self.name = name", "self.name = name").signal == "accept"
    assert intent_reaction("self.name = name", "self.name = name").full
    partial = intent_reaction("self.name = other", "self.name = name")
    assert (partial.signal, partial.value, partial.full) == ("accept", 12, False)
    assert intent_reaction("zzz", "self").signal == "reject"
    assert intent_reaction("\n", "self").signal == ""


def test_invented_names_are_those_neither_the_code_base_nor_python_knows():
    known = known_names(["def parse_event(raw):\n    return raw\n"])
    assert invented_names("(raw)", "return parse_", known) == []  # continues the prompt's name
    assert invented_names("ribution_taskerderr = 1", "x = self", known) == ["selfribution_taskerderr"]
    assert invented_names(" = len(raw) + BURERUWF", "", known) == ["BURERUWF"]
    assert invented_names(" = pars", "x", known, truncated=True) == []  # cut mid-name at the end
    assert invented_names(" = pars", "x", known, truncated=False) == ["pars"]


def test_numbers_and_the_language_are_not_names_to_invent():
    known = known_names([])
    assert invented_names(" = 0x1f + 1e10", "x", known) == []
    assert {"isinstance", "append", "collections", "self", "match"} <= language_names()
