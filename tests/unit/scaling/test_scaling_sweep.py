"""IsoFLOP design, launch commands and result collection."""

import csv
import json

import pytest

from densetrain.models.sizing import param_counts
from densetrain.scaling.runner import collect_results, run_sweep
from densetrain.scaling.shapes import candidate_shapes, nearest_shape
from densetrain.scaling.sweep import SweepConfig, design_sweep, launch_command, slurm_script

CFG = SweepConfig(budgets=[1e12, 3e12, 1e13], sizes_per_budget=5, seq_len=128,
                  global_batch_size=32, micro_batch_size=16, vocab_size=1024,
                  param_count="non_embedding", tokens_per_param=20.0)


def _non_embedding_on_meta(shape, vocab_size, seq_len):
    """Independent count: parameters of a meta-built Transformer outside the embeddings."""
    import torch

    from densetrain.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(shape.model_config(vocab_size=vocab_size, max_seq_len=seq_len))
    return sum(p.numel() for name, p in model.named_parameters()
               if not name.startswith(("tok_embeddings", "output")))


def test_design_spends_each_budget():
    points = design_sweep(CFG)
    for budget in CFG.budgets:
        group = [p for p in points if p.budget == budget]
        assert len(group) >= 4
        sizes = [p.params for p in group]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
        assert max(sizes) / min(sizes) > 8
        for p in group:
            # D = C / (6N) up to rounding to whole steps
            assert abs(6 * p.params * p.tokens - budget) <= 6 * p.params * CFG.tokens_per_step
            assert p.tokens == p.steps * 32 * 128


def test_design_counts_match_a_built_model():
    points = design_sweep(CFG)
    for p in (points[0], points[-1]):
        assert p.params == _non_embedding_on_meta(p.shape, 1024, 128)


def test_default_design_counts_all_parameters():
    """The default (Chinchilla's total N): counts equal a meta-built model's, and each budget
    is spent as 6·N·D within one step."""
    import torch

    from densetrain.models.transformer import Transformer

    cfg = SweepConfig(budgets=[1e12, 3e12, 1e13])
    points = design_sweep(cfg)
    assert {p.budget for p in points} == {1e12, 3e12, 1e13}
    for p in points:
        with torch.device("meta"):
            model = Transformer(p.shape.model_config(vocab_size=cfg.vocab_size,
                                                     max_seq_len=cfg.seq_len))
        assert p.params == sum(t.numel() for t in model.parameters())
        assert abs(6 * p.params * p.tokens - p.budget) <= 6 * p.params * cfg.tokens_per_step


def test_nearest_shape_is_nearest_by_sizing():
    shapes = candidate_shapes()
    shape, count = nearest_shape(2e5, vocab_size=512, max_seq_len=128, tolerance=0.0)
    best = min(abs(param_counts(s.model_config(vocab_size=512, max_seq_len=128)).non_embedding
                   - 2e5) for s in shapes)
    assert abs(count - 2e5) == best
    total_shape, total = nearest_shape(2e6, vocab_size=512, max_seq_len=128,
                                       param_count="total")
    assert total == param_counts(total_shape.model_config(vocab_size=512,
                                                          max_seq_len=128)).total
    assert abs(total / 2e6 - 1) < 0.15


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="sizes_per_budget"):
        design_sweep(SweepConfig(budgets=[1e12], sizes_per_budget=2))
    with pytest.raises(ValueError, match=r"budgets\[1\]"):
        design_sweep(SweepConfig(budgets=[1e12, -1]))
    with pytest.raises(ValueError, match="micro_batch_size"):
        design_sweep(SweepConfig(budgets=[1e12], global_batch_size=32, micro_batch_size=5))
    with pytest.raises(ValueError, match="distinct runs"):
        design_sweep(SweepConfig(budgets=[1e9]))


def test_overrides_are_accepted_by_the_job_config(tmp_path):
    config = pytest.importorskip("densetrain.config")
    point = design_sweep(CFG)[2]
    command = launch_command(point, CFG, str(tmp_path / "run"))
    overrides = command[command.index("train") + 1:]
    job = config.load_job_config(None, overrides)
    model = job.build_model_config(1024)
    assert (model.dim, model.num_layers, model.ffn_dim) == (
        point.shape.dim, point.shape.num_layers, point.shape.ffn_dim)
    assert param_counts(model).non_embedding == point.params
    assert job.training.steps == point.steps


def test_torchrun_and_slurm_commands():
    point = design_sweep(CFG)[0]
    cmd = launch_command(point, CFG, "/runs/x", launcher="torchrun", nproc_per_node=8)
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "densetrain"]
    script = slurm_script(point, CFG, "/runs/x", nproc_per_node=8, nnodes=4)
    assert "#SBATCH --nodes=4" in script and "--nnodes=4" in script
    assert "--logging.run_dir=/runs/x" in script
    with pytest.raises(ValueError, match="launcher"):
        launch_command(point, CFG, "/runs/x", launcher="mpirun")


def test_dry_run_prints_and_runs_nothing(tmp_path):
    points = design_sweep(CFG)
    printed = []
    assert run_sweep(points, CFG, tmp_path, dry_run=True, echo=printed.append) is None
    assert len(printed) == len(points)
    assert not (tmp_path / "runs").exists()
    assert (tmp_path / "design.csv").is_file()


def test_collect_reads_finished_runs(tmp_path):
    points = design_sweep(CFG)
    run_sweep(points, CFG, tmp_path, dry_run=True, echo=lambda s: None)
    for i, p in enumerate(points[:4]):  # the others are unfinished
        run_dir = tmp_path / "runs" / p.name
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({
            "final_loss": 3.0 + i, "final_val_loss": 3.1 + i, "tokens": p.tokens,
            "steps": p.steps, "params": p.params + 65536, "non_embedding_params": p.params,
            "flops": 1.5 * p.flops,
        }))
    with (collect_results(tmp_path)).open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["name"] for r in rows] == [p.name for p in points[:4]]
    assert float(rows[1]["loss"]) == 4.1
    assert float(rows[0]["flops"]) == pytest.approx(6 * points[0].params * points[0].tokens)
    with pytest.raises(ValueError, match="'final_val_loss' is missing"):
        bad = tmp_path / "runs" / points[0].name / "summary.json"
        bad.write_text(json.dumps({"tokens": 1, "params": 2, "non_embedding_params": 1}))
        collect_results(tmp_path)
