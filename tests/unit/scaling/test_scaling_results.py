"""Results CSV validation: errors name the file, line and column."""

import json

import pytest

from densetrain.scaling.fit_common import FitError
from densetrain.scaling.fit_isoflop import fit_isoflop
from densetrain.scaling.results import (
    load_loss_curve,
    load_results_csv,
    table_from_rows,
    write_results_csv,
)


def _write(tmp_path, text):
    path = tmp_path / "results.csv"
    path.write_text(text)
    return path


def test_round_trip(tmp_path):
    rows = [{"params": 1e6, "tokens": 2e7, "flops": 1.2e14, "loss": 3.5, "name": "a"},
            {"params": 2e6, "tokens": 1e7, "flops": 1.2e14, "loss": 3.4, "name": "b"}]
    path = tmp_path / "out.csv"
    write_results_csv(path, rows, ["name", "params", "tokens", "flops", "loss"])
    table = load_results_csv(path)
    assert table.params.tolist() == [1e6, 2e6]
    assert table.rows[1]["name"] == "b"
    assert not list(tmp_path.glob(".*.tmp"))


def test_missing_column_is_named(tmp_path):
    path = _write(tmp_path, "params,tokens,loss\n1e6,1e7,3.0\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['flops'\]"):
        load_results_csv(path)


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "abc", ""])
def test_bad_value_names_line_and_column(tmp_path, bad):
    path = _write(tmp_path, f"params,tokens,flops,loss\n1e6,1e7,6e13,3.0\n2e6,{bad},6e13,2.9\n")
    with pytest.raises(ValueError, match=r"line 3, column 'tokens'"):
        load_results_csv(path)


def test_bad_optional_budget_is_named(tmp_path):
    path = _write(tmp_path, "params,tokens,flops,loss,budget\n1e6,1e7,6e13,3.0,-1\n")
    with pytest.raises(ValueError, match=r"line 2, column 'budget'"):
        load_results_csv(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_results_csv(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="empty file"):
        load_results_csv(_write(tmp_path, ""))
    with pytest.raises(ValueError, match="no runs"):
        load_results_csv(_write(tmp_path, "params,tokens,flops,loss\n"))


def test_too_few_points_says_how_many_are_needed():
    table = table_from_rows([{"params": 1e6, "tokens": 1e7, "flops": 6e13, "loss": 3.0},
                             {"params": 2e6, "tokens": 5e6, "flops": 6e13, "loss": 2.9}])
    with pytest.raises(FitError, match="at least 3"):
        fit_isoflop(table)


def test_loss_curve_reads_metrics_jsonl(tmp_path):
    lines = [{"step": 1, "tokens": 100, "loss": 5.0}, {"step": 2, "val_loss": 4.9},
             {"step": 2, "tokens": 200, "loss": 4.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    curve = load_loss_curve(tmp_path)
    assert curve.tolist() == [[100.0, 5.0], [200.0, 4.5]]
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_loss_curve(tmp_path)
