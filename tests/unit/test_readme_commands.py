"""The README's command list is complete and current: every `densetrain` sub-command (nested
groups such as ``data``, ``eval`` and ``scaling`` included) has a line in it, and every line of it
names a command that exists.

The list is the first ``bash`` block of the README's "## The command line" section; a line's
command is the words after ``densetrain`` that the parser of `densetrain.cli.main.build_parser`
knows as sub-commands (``densetrain data prepare --help`` names ``data prepare``).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from densetrain.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## The command line"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def parser_commands() -> set[tuple[str, ...]]:
    """Every runnable command of `densetrain --help`, as its words: the leaves of the tree of
    sub-parsers (``("train",)``, ``("data", "prepare")``, ...)."""
    commands: set[tuple[str, ...]] = set()

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for name, sub in _subparsers(parser).items():
            if _subparsers(sub):
                walk(sub, (*prefix, name))
            else:
                commands.add((*prefix, name))

    walk(build_parser(), ())
    return commands


def readme_command_lines() -> list[str]:
    """The lines of the README's command list that start with ``densetrain``."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert "```bash" in section, "the command-line section has no ```bash block"
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("densetrain")]


def command_of(line: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The sub-command words of ``line`` (empty for ``densetrain --version``); a word that is
    not a sub-command where the parser expects one is kept, so that the test names it."""
    words = [w for w in shlex.split(line, comments=True)[1:] if w != "--debug"]
    command: list[str] = []
    while words and not words[0].startswith("-"):
        choices = _subparsers(parser)
        if not choices:
            break
        word = words.pop(0)
        command.append(word)
        if word not in choices:
            break
        parser = choices[word]
    return tuple(command)


def test_parser_has_nested_groups():
    commands = parser_commands()
    for group in ("data", "eval", "scaling"):
        assert any(c[0] == group and len(c) == 2 for c in commands), group


def test_every_subcommand_is_in_the_readme_and_every_listed_command_exists():
    parser = build_parser()
    listed = {command_of(line, parser) for line in readme_command_lines()} - {()}
    existing = parser_commands()
    missing = sorted(" ".join(c) for c in existing - listed)
    unknown = sorted(" ".join(c) for c in listed - existing)
    assert not missing, f"README.md's command list lacks: {missing}"
    assert not unknown, f"README.md's command list names commands that do not exist: {unknown}"
