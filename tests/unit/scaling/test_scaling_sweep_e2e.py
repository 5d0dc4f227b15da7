"""A real (small) IsoFLOP sweep through `densetrain train` subprocesses (slow: --runslow)."""

import pytest

from densetrain.scaling.results import load_results_csv
from densetrain.scaling.runner import run_sweep
from densetrain.scaling.sweep import SweepConfig, design_sweep


@pytest.mark.slow
def test_tiny_sweep_runs_and_collects(tmp_path):
    cfg = SweepConfig(budgets=[3e9, 1e10], sizes_per_budget=3, n_span=4.0, seq_len=64,
                      param_count="non_embedding", tokens_per_param=20.0,
                      global_batch_size=8, micro_batch_size=8, min_steps=10, vocab_size=1024,
                      extra_overrides=["--eval.num_batches=2"])
    points = design_sweep(cfg)
    results = run_sweep(points, cfg, tmp_path, jobs=2, threads=1, echo=lambda s: None)
    table = load_results_csv(results)
    assert len(table) == len(points)
    for point, row in zip(points, table.rows, strict=True):
        assert int(float(row["tokens"])) == point.tokens
        assert int(float(row["params"])) == point.params
        # the trainer's FLOP count includes the output layer and attention, beyond 6·N·D
        assert float(row["flops_actual"]) > float(row["flops"])
    # a second call finds every run finished and only collects
    messages = []
    run_sweep(points, cfg, tmp_path, echo=messages.append)
    assert all("done already" in m for m in messages)
