"""Only input errors are one line: a `UserError` (or an ``OSError`` naming a path) prints one
line and exits `EXIT_USER_ERROR`; any other exception raised inside a command — a plain
``ValueError`` from a bug included — prints its traceback and a line saying it is a bug to
report, and exits `EXIT_INTERNAL_ERROR`.
"""

from __future__ import annotations

import errno

import pytest

from densetrain.cli.main import EXIT_INTERNAL_ERROR, EXIT_USER_ERROR, main
from densetrain.errors import MissingDependencyError, UserError, UserFileNotFoundError


def _presets_raising(monkeypatch, error: BaseException) -> None:
    """Make ``densetrain presets`` meet ``error`` deep inside it (in the parameter count)."""
    from densetrain.models import sizing

    def param_counts(cfg):
        raise error

    monkeypatch.setattr(sizing, "param_counts", param_counts)


@pytest.mark.parametrize("error", [
    ValueError("head_dim mismatch in the attention split"),
    TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"),
    KeyError("num_heads"),
    OSError("an OSError that names no path"),
], ids=["ValueError", "TypeError", "KeyError", "OSError-no-path"])
def test_an_internal_error_prints_its_traceback_and_asks_for_a_report(monkeypatch, capsys,
                                                                       error):
    _presets_raising(monkeypatch, error)
    code = main(["presets"])
    err = capsys.readouterr().err
    assert code == EXIT_INTERNAL_ERROR, err
    assert "Traceback (most recent call last)" in err
    assert "in param_counts" in err  # the frame that raised it, not only main's
    assert f"densetrain presets: error: internal error {type(error).__name__}" in err
    assert "this is a bug in densetrain" in err and "please report it" in err


@pytest.mark.parametrize("error", [
    UserError("model.dim must be a positive integer, got 0"),
    UserFileNotFoundError("tokenizer file /no/such/tokenizer.json does not exist"),
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such/file.toml"),
    OSError(errno.ENOSPC, "No space left on device"),
    MissingDependencyError("lm-evaluation-harness is not installed; `pip install lm-eval`"),
], ids=["UserError", "UserFileNotFoundError", "OSError-with-path", "ENOSPC", "missing-extra"])
def test_an_input_error_stays_one_line(monkeypatch, capsys, error):
    _presets_raising(monkeypatch, error)
    code = main(["presets"])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR, err
    assert "Traceback" not in err and "bug" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("densetrain presets: error: "), err


def test_debug_still_shows_an_input_errors_traceback(monkeypatch, capsys):
    _presets_raising(monkeypatch, UserError("model.dim must be a positive integer, got 0"))
    assert main(["presets", "--debug"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "bug" not in err
    assert err.strip().splitlines()[-1] == \
        "densetrain presets: error: model.dim must be a positive integer, got 0"


def test_user_errors_are_still_value_errors():
    """Callers that catch ``ValueError`` / ``FileNotFoundError`` keep working."""
    assert issubclass(UserError, ValueError)
    assert issubclass(UserFileNotFoundError, FileNotFoundError)
    assert issubclass(MissingDependencyError, ImportError)
