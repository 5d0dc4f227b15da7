"""`densetrain plan` and the compute-optimal run plan."""

from __future__ import annotations

import pytest

from densetrain.cli.main import main
from densetrain.models.presets import get_preset, list_presets
from densetrain.models.sizing import param_counts
from densetrain.planner.hardware import get_cluster
from densetrain.planner.run_plan import plan_run, shape_for_params
from densetrain.scaling.optimal import allocation


@pytest.mark.parametrize("target", [1e9, 7e10, 4e11])
def test_shape_for_params_is_within_five_percent(target):
    cfg = shape_for_params(target, get_preset("llama3-8b"))
    assert abs(param_counts(cfg).total / target - 1) <= 0.05
    assert cfg.num_heads % 8 == 0 and cfg.head_dim == 128


def test_run_plan_chains_optimal_n_d_to_the_search():
    flops = 1e23
    split = allocation(flops)
    n_opt, d_opt = split.num_params, split.num_tokens
    assert 6 * n_opt * d_opt == pytest.approx(flops, rel=0.02)  # C = 6 N D
    plan = plan_run(split, base=get_preset("llama3-8b"), seq_len=4096, global_batch=512,
                    devices=256, cluster=get_cluster("h100"))
    assert abs(plan.num_params / n_opt - 1) <= 0.05
    tokens_per_s = plan.layout_plan.row(0)["tokens_per_s"]
    assert plan.training_days == pytest.approx(d_opt / tokens_per_s / 86400)


def test_cli_plan_prints_winner_and_table(capsys):
    code = main(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "256",
                 "--cluster", "h200", "--devices", "64", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Winner:" in out and "MFU" in out and "Close ones:" in out


def test_cli_flops_prints_run_plan(capsys):
    code = main(["plan", "--flops", "1e22", "--devices", "64", "--global-batch", "256"])
    out = capsys.readouterr().out
    assert code == 0
    assert "N_opt" in out and "days" in out and "Layout:" in out


def test_cli_infeasible_request_says_why(capsys):
    code = main(["plan", "--model", "palm-540b", "--cluster", "a100-40gb", "--devices", "8",
                 "--seq-len", "2048", "--global-batch", "64"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Binding constraint: model states" in err


def test_cli_custom_cluster_file_and_listing(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text("[clusters.mygpu]\npeak_tflops = 400\nmemory_gb = 64\nhbm_tb_s = 2\n"
                    "devices_per_node = 4\nintra_node_gb_s = 100\ninter_node_gb_s = 25\n"
                    "gemm_efficiency = 0.8\ngemm_half_dim = 128\nattention_efficiency = 0.4\n")
    assert main(["plan", "--list-clusters", "--cluster-file", str(path)]) == 0
    assert "mygpu" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt2-124m", "--cluster", "mygpu", "--cluster-file",
                 str(path), "--devices", "8", "--seq-len", "1024", "--global-batch", "64"]) == 0
    assert "8 x mygpu" in capsys.readouterr().out


def test_cli_bad_input_is_an_error_not_a_table(capsys):
    assert main(["plan", "--model", "llama3-8b"]) == 2
    assert "--devices is required" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model", "--devices", "8"]) == 2
    assert "unknown model preset" in capsys.readouterr().err


def test_cli_model_from_a_config_file(tmp_path, capsys):
    path = tmp_path / "model.toml"
    path.write_text("[model]\nvocab_size = 32000\ndim = 1024\nnum_layers = 8\nnum_heads = 8\n")
    assert main(["plan", "--model", str(path), "--devices", "8", "--seq-len", "2048",
                 "--global-batch", "32"]) == 0
    assert "model dim 1024, 8 layers" in capsys.readouterr().out


@pytest.mark.parametrize("name", list_presets())
def test_a_preset_written_as_json_loads_as_the_same_config(tmp_path, name):
    # `to_dict` output (rope_scaling as a table, None for derived sizes) read back through the
    # typed loader gives the preset itself, so the file plans exactly as the preset does.
    import json

    from densetrain.cli.plan_cmd import _load_model

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(get_preset(name).to_dict()))
    assert _load_model(str(path)) == get_preset(name)


def test_plan_and_help_import_no_torch():
    """`densetrain plan` and `densetrain --help` never import torch (the planner reads configs
    and counts only); the torch model still imports on first use afterwards."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from densetrain.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--model', 'llama3-8b', '--devices', '64', '--top', '1']) == 0\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from densetrain.models import Transformer, get_preset\n"
        "assert 'torch' in sys.modules and Transformer.__name__ == 'Transformer'\n"
        "assert get_preset('llama3-8b').num_layers == 32\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runners_up_show_the_ties_in_one_line_then_layouts_that_are_slower():
    from densetrain.planner.report import TIE, _signature, explain_runners_up
    from densetrain.planner.search import search

    result = search(get_preset("gpt2-124m"), seq_len=4096, global_batch=1024, devices=8,
                    cluster=get_cluster("h100"))
    best = result.row(0)
    distinct, ties = {_signature(result, 0)}, []
    for i in range(1, len(result)):
        if _signature(result, i) not in distinct:
            distinct.add(_signature(result, i))
            if 1 - result.row(i)["tokens_per_s"] / best["tokens_per_s"] < TIE:
                ties.append(i)
    assert len(ties) > 1  # a small model on 8 GPUs: ZeRO stages and micro-batches tie
    text = explain_runners_up(result)
    assert f"Tied with the winner ({len(ties)} layouts within 0.1%" in text
    def traffic(row):
        return row["tp_bytes"] + row["dp_bytes"] + row["pp_bytes"] + row["cp_bytes"]

    # equal speed: the layout that moves the fewest bytes, then the smallest, wins
    assert all(traffic(best) <= traffic(result.row(i)) for i in ties)
    assert any(traffic(best) < traffic(result.row(i)) for i in ties)  # z3 moves far more
    assert all(best["mem_total"] <= result.row(i)["mem_total"] for i in ties
               if traffic(result.row(i)) == traffic(best))
    assert result.layout(0).zero_stage < 3
    assert ("the winner moves the fewest bytes of them, and needs the least memory of those "
            "that move as few") in text
    close = [line for line in text.split("Close ones:\n")[1].splitlines() if line.strip()]
    assert len(close) == 4
    assert all(float(line.split(": ")[1].split("%")[0]) >= 100 * TIE for line in close)
