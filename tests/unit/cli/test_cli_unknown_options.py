"""Parser errors: an option a command lacks (with the option it likely means), a bad flag value."""

from __future__ import annotations

import pytest

from densetrain.cli.main import main


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, command, hint",
    [
        # another tool's name for the option (torchrun / Megatron-LM)
        (["plan", "--model", "llama3-8b", "--gpus", "8"], "plan",
         "--gpus: did you mean --devices?"),
        # a typo, found by similarity among the command's own options
        (["plan", "--devcies", "8"], "plan", "--devcies: did you mean --devices?"),
        (["eval", "perplexity", "m", "--bach-size", "3"], "eval perplexity",
         "--bach-size: did you mean --batch-size?"),
        (["plan", "--seq-length=4096"], "plan", "--seq-length: did you mean --seq-len?"),
    ],
)
def test_unknown_option_names_the_command_and_the_likely_option(capsys, argv, command, hint):
    line = _error(capsys, argv)
    assert line.startswith(f"densetrain {command}: error: unrecognized arguments: ")
    assert hint in line
    assert f"`densetrain {command} --help` lists the options" in line


def test_unknown_option_without_a_likely_one_gets_no_guess(capsys):
    line = _error(capsys, ["presets", "--zzzz"])
    assert line == ("densetrain presets: error: unrecognized arguments: --zzzz; "
                    "`densetrain presets --help` lists the options")


def test_alias_is_not_suggested_where_the_command_lacks_its_target(capsys):
    # `presets` has no --devices: --gpus gets no suggestion rather than a wrong one.
    line = _error(capsys, ["presets", "--gpus", "8"])
    assert "did you mean" not in line


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "five"])
@pytest.mark.parametrize("command", [["export", "run"],
                                     ["convert", "--to-hf", "run", "--out", "o"]])
def test_shard_size_must_be_a_number_above_zero(capsys, tmp_path, command, value):
    # Refused by the parser, before any source is read (the source here does not exist).
    line = _error(capsys, command + (["--to-hf", str(tmp_path)] if command[0] == "export" else [])
                  + ["--max-shard-gb", value])
    assert line == (f"densetrain {command[0]}: error: argument --max-shard-gb: must be a number "
                    f"of GB above 0 (e.g. 5), got '{value}'")


@pytest.mark.parametrize("argv, flag, allowed", [
    (["eval", "perplexity", "m", "--text", "t", "--batch-size", "0"], "--batch-size", ">= 1"),
    (["eval", "perplexity", "m", "--text", "t", "--seq-len", "-4"], "--seq-len",
     ">= 0 (0 = the model's max_seq_len)"),
    (["eval", "perplexity", "m", "--text", "t", "--stride", "x"], "--stride",
     ">= 0 (0 = --seq-len)"),
    (["eval", "perplexity", "m", "--text", "t", "--max-documents", "-1"], "--max-documents",
     ">= 0 (0 = all)"),
    (["eval", "tasks", "m", "--task", "x", "--shots", "-1"], "--shots", ">= 0"),
    (["eval", "tasks", "m", "--task", "x", "--limit", "1.5"], "--limit", ">= 0 (0 = all)"),
    (["eval", "harness", "m", "--tasks", "x", "--shots", "-2"], "--shots", ">= 0"),
    (["generate", "m", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens", ">= 0"),
    (["data", "inspect", "ds", "--sample-tokens", "-1"], "--sample-tokens", ">= 0 (0: none shown)"),
    (["plan", "--model", "gpt2-124m", "--devices", "0"], "--devices", ">= 1"),
    (["plan", "--model", "gpt2-124m", "--devices", "8", "--top", "0"], "--top", ">= 1"),
    (["plan", "--model", "gpt2-124m", "--devices", "8", "--max-tp", "0"], "--max-tp",
     ">= 1 (1 = no tensor-parallel split)"),
    (["plan", "--model", "gpt2-124m", "--devices", "8", "--seq-len", "x"], "--seq-len", ">= 1"),
    (["plan", "--calibrate", "c.toml", "--calibrate-ranks", "1"], "--calibrate-ranks",
     ">= 2 (collectives need two processes)"),
    # accepted before, and passed on to every run of the sweep
    (["scaling", "sweep", "--out", "s", "--dry-run", "--threads", "0"], "--threads", ">= 1"),
    (["scaling", "sweep", "--out", "s", "--dry-run", "--nnodes", "0"], "--nnodes", ">= 1"),
    (["scaling", "sweep", "--out", "s", "--dry-run", "--nproc-per-node", "0"],
     "--nproc-per-node", ">= 1"),
    (["scaling", "sweep", "--out", "s", "--dry-run", "--micro-batch-size", "0"],
     "--micro-batch-size", ">= 1"),
    (["scaling", "sweep", "--out", "s", "--sizes-per-budget", "2"], "--sizes-per-budget",
     ">= 3 (a parabola needs 3 points)"),
])
def test_eval_and_generate_counts_are_refused_by_the_parser(capsys, argv, flag, allowed):
    # Refused before any model is read (the model path here does not exist).
    line = _error(capsys, argv)
    assert f"error: argument {flag}: must be an integer {allowed}, got '{argv[-1]}'" in line


@pytest.mark.parametrize("argv, flag, allowed", [
    (["plan", "--model", "gpt2-124m", "--devices", "8", "--efficiency", "2"], "--efficiency",
     "above 0 and at most 1"),
    (["plan", "--model", "gpt2-124m", "--devices", "8", "--efficiency", "nan"], "--efficiency",
     "above 0 and at most 1"),
    (["plan", "--devices", "8", "--flops", "-1"], "--flops", "above 0"),
    (["plan", "--flops", "1e21", "--devices", "8", "--inference-tokens", "-5"],
     "--inference-tokens", "at least 0"),
    (["scaling", "optimal", "--flops", "-3"], "--flops", "above 0"),
    (["scaling", "sweep", "--out", "s", "--n-span", "0.5"], "--n-span", "above 1"),
    (["scaling", "sweep", "--out", "s", "--lr", "nan"], "--lr", "above 0"),
])
def test_plan_numbers_are_refused_by_the_parser(capsys, argv, flag, allowed):
    line = _error(capsys, argv)
    assert f"error: argument {flag}: must be a finite number {allowed}, got '{argv[-1]}'" in line


def test_every_option_of_every_command_has_help_text():
    import argparse

    from densetrain.cli.main import build_parser

    bare = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and not action.help:
                bare.append(f"{' '.join(path)} {action.option_strings[-1]}")

    walk(build_parser(), ["densetrain"])
    assert bare == []
