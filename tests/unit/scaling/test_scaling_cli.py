"""`densetrain scaling optimal | fit | sweep --dry-run` end to end on synthetic tables."""

import json

import pytest

from densetrain.cli.main import main
from densetrain.scaling.results import write_results_csv


def test_optimal_prints_chinchilla_40b(capsys):
    assert main(["scaling", "optimal", "--flops", "5.76e23"]) == 0
    out = capsys.readouterr().out
    assert "N_opt  = 4.03" in out and "e+10 parameters" in out


def test_optimal_rejects_bad_budget(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["scaling", "optimal", "--flops", "-3"])
    assert refused.value.code == 2
    assert "argument --flops: must be a finite number above 0" in capsys.readouterr().err


def test_fit_writes_report_json_and_plots(tmp_path, capsys, make_isoflop_rows):
    rows = make_isoflop_rows(budgets=(1e18, 1e19, 1e20), sizes=6, noise=0.003, span=10.0)
    csv_path = tmp_path / "results.csv"
    write_results_csv(csv_path, rows, ["params", "tokens", "flops", "loss", "budget"])
    code = main(["scaling", "fit", str(csv_path), "--bootstrap", "2", "--max-starts", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "approach 2 (IsoFLOP): a = " in out
    assert "approach 3 (parametric)" in out
    # no run_dir column: approach 1 is reported as not fitted, with the reason
    assert "NOT FITTED approach1_envelope: " in out and "run_dir" in out
    doc = json.loads((tmp_path / "fit.json").read_text())
    assert 0.4 < doc["isoflop"]["a"]["value"] < 0.52
    for name in ("isoflop.png", "frontier.png", "residuals.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["scaling", "optimal", "--flops", "1e20", "--fit", str(tmp_path / "fit.json")]) == 0


def test_fit_bad_csv_names_the_column(tmp_path, capsys):
    path = tmp_path / "r.csv"
    path.write_text("params,tokens,loss\n1,2,3\n")
    assert main(["scaling", "fit", str(path)]) == 2
    assert "missing column(s) ['flops']" in capsys.readouterr().err


def test_sweep_dry_run_prints_commands(tmp_path, capsys):
    code = main(["scaling", "sweep", "--out", str(tmp_path), "--budgets", "1e12,1e13",
                 "--sizes-per-budget", "4", "--dry-run", "--launcher", "torchrun",
                 "--nproc-per-node", "2", "--training.dtype=bf16"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert len(lines) == 8
    assert all(line.startswith("torchrun --standalone --nproc-per-node=2 -m densetrain train")
               and line.endswith("--training.dtype=bf16") for line in lines)
