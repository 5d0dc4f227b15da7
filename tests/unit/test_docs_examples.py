"""Every command in README.md and docs/*.md runs as written.

Commands are the lines of fenced code blocks (``bash``, ``sh``, ``shell`` or unlabeled) that
start with ``densetrain``, ``make`` or ``torchrun`` (continuation lines joined). Not run:

- synopses: a ``[...]`` option, an ``a|b`` choice, ``...`` or an upper-case placeholder
  (``MODEL``, ``HF_DIR``, ``DIR/fit.json``);
- commands marked in the document by a comment on one of their lines or the line above:
  ``(cluster)`` (needs more machines than a test has), ``(this suite)`` (runs these tests),
  ``(your files)`` (needs the reader's own files) or ``(hours)`` (too long for a test);
- ``PENDING_MARKERS``: commands in documents owned elsewhere that still lack their marker.

Each document's commands run in order (a later one may use an earlier one's output) in a fresh
directory holding links to the repository's ``configs/``, Makefile and environment. Quick
``densetrain`` commands (help, printing, planning) run in the default suite, in this process
through the console script's ``main``; the whole sequence, as shell commands, in the slow one.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKERS = ("(cluster)", "(this suite)", "(your files)", "(hours)")
PENDING_MARKERS = {  # (document, start of the command): why it cannot run as written
    ("docs/scaling.md", "densetrain scaling sweep --out runs/sweep --jobs 2"):
        "the recorded sweep: hours of CPU",
    ("docs/scaling.md", "densetrain scaling fit runs/sweep/results.csv --bootstrap"):
        "needs that sweep; writes into docs/scaling",
    ("docs/scaling.md", "densetrain scaling collect runs/sweep"): "needs a finished sweep",
}
_FENCE = re.compile(r"^```(\w*)\s*$")
_PLACEHOLDER = re.compile(r"(^|[/=])[A-Z][A-Z_]+([./]|$)")
_PROGRAMS = ("densetrain", "make", "torchrun")
_QUICK = ("--help", "--print-config", "--version", "--dry-run", "model-info", "presets", "plan",
          "optimal")


@dataclass(frozen=True)
class Command:
    """One documented command: its text, where it is, and whether it runs."""

    document: str
    line: int
    text: str
    context: str  # the command's lines plus the comment line above

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    def skip_reason(self) -> str | None:
        for marker in MARKERS:
            if marker in self.context:
                return f"marked {marker}"
        for (document, start), reason in PENDING_MARKERS.items():
            if document == self.document and self.text.startswith(start):
                return reason
        if any(w.startswith("[") or "|" in w or w == "..." or _PLACEHOLDER.search(w)
               for w in self.words):
            return "synopsis"
        return None

    @property
    def quick(self) -> bool:
        words = self.words
        return words[0] == "densetrain" and any(w in _QUICK for w in words[1:3] + words[-1:])


def extract_commands(path: Path) -> list[Command]:
    """The commands of ``path`` (see the module docstring)."""
    commands, fence, previous = [], None, ""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        match = _FENCE.match(line.strip())
        if match:
            fence = None if fence is not None else match.group(1)
            index += 1
            continue
        start = index
        if fence in ("bash", "sh", "shell", "") and line.split(" ", 1)[0] in _PROGRAMS:
            parts = [line]
            while parts[-1].split("#", 1)[0].rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                parts.append(lines[index])
            text = " ".join(p.split("#", 1)[0].rstrip().removesuffix("\\").strip()
                            if p.split("#", 1)[0].rstrip().endswith("\\") else p.strip()
                            for p in parts)
            commands.append(Command(document=str(path.relative_to(REPO)), line=start + 1,
                                    text=text, context="\n".join([previous, *parts])))
        previous = line if line.strip().startswith("#") else ""
        index += 1
    return commands


ALL = [c for path in DOCUMENTS for c in extract_commands(path)]


def _workdir(tmp_path: Path) -> Path:
    for name in ("configs", "Makefile", "pyproject.toml", "src", ".venv"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def _run(command: Command, cwd: Path, timeout: float) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(command.text, shell=True, cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{command.document}:{command.line}: `{command.text}` exited {result.returncode}\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )


def test_every_document_has_commands_and_every_skip_is_explained():
    assert len(ALL) > 20
    runnable = [c for c in ALL if c.skip_reason() is None]
    assert any(c.words[0] == "torchrun" for c in runnable)
    assert any(c.words[:2] == ["densetrain", "export"] for c in runnable)
    for (document, start) in PENDING_MARKERS:
        assert any(c.document == document and c.text.startswith(start) for c in ALL), start


@pytest.mark.parametrize("command", [c for c in ALL if c.skip_reason() is None and c.quick],
                         ids=lambda c: f"{c.document}:{c.line}")
def test_quick_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    # In this process through the console script's own entry point (same parser, same words):
    # a subprocess per command would spend most of its time importing torch.
    from densetrain.cli.main import main

    monkeypatch.chdir(_workdir(tmp_path))
    try:
        code = main(command.words[1:])
    except SystemExit as exit_info:  # --help and --version exit through argparse
        code = exit_info.code
    captured = capsys.readouterr()
    assert code == 0, f"{command.document}:{command.line}: `{command.text}`\n{captured.err}"
    assert captured.out.strip()


@pytest.mark.slow
@pytest.mark.parametrize("document", sorted({c.document for c in ALL}))
def test_every_command_of_a_document_runs_in_order(document, tmp_path):
    cwd = _workdir(tmp_path)
    for command in ALL:
        if command.document == document and command.skip_reason() is None:
            _run(command, cwd, timeout=3600)
