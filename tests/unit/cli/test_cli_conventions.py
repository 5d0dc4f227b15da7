"""Command-line conventions: --version, `--field value`, `presets`, help texts for users."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from importlib.metadata import version

import pytest

from densetrain.cli.main import build_parser, main
from densetrain.models import get_preset, list_presets
from densetrain.models.sizing import param_counts


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"densetrain {version('densetrain')}"


def test_space_separated_override_values_are_overrides_not_config_files(capsys, tmp_path):
    assert main(["train", "--training.steps", "10", "--optim.lr", "1e-3", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "\nsteps = 10\n" in printed and "\nlr = 0.001\n" in printed
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 40\n")
    assert main(["train", str(config), "--training.seed", "3", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "\nsteps = 40\n" in printed and "\nseed = 3\n" in printed
    assert main(["train", "--training.steps=5", str(config)]) == 2
    assert "CONFIG file comes before the overrides" in capsys.readouterr().err


def test_presets_lists_every_preset_with_its_size(capsys):
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in rows) == list_presets()
    for row in rows:
        assert row["total_params"] == param_counts(get_preset(row["name"])).total
    assert main(["presets", "--family", "llama3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["llama3-8b", "llama3-70b", "llama3-405b"]
    assert "8.03B" in lines[1]
    assert main(["presets", "--family", "llama4"]) == 2
    assert "families:" in capsys.readouterr().err


def _all_help_texts() -> list[str]:
    parser = build_parser()
    texts = [parser.format_help()]
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                for sub in choices.values():
                    texts.append(sub.format_help())
                    stack.append(sub)
    return texts


def test_help_texts_name_no_source_files():
    texts = _all_help_texts()
    assert len(texts) > 15
    for text in texts:
        assert ".py" not in text, text[:200]


def test_importing_and_parsing_emit_no_warnings():
    code = ("import warnings; warnings.simplefilter('error'); "
            "from densetrain.cli.main import build_parser; build_parser().format_help(); "
            "import densetrain.export, densetrain.models.hf")
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_parser()


@pytest.mark.parametrize("command", [["presets"], ["model-info", "llama3-8b", "--json"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(command):
    """``densetrain presets | head -1``: a closed pipe is no error of the user's or ours; like
    Unix tools the command stops without a word, with the shell's code for SIGPIPE (141)."""
    proc = subprocess.Popen([sys.executable, "-m", "densetrain", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""
