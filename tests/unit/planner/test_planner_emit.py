"""The job the planner emits trains the output head that the planner's memory model counted."""

from __future__ import annotations

from densetrain.config import load_job_config
from densetrain.models.config import ModelConfig
from densetrain.planner.emit import plan_job
from densetrain.planner.hardware import get_cluster
from densetrain.planner.layout import PlanSettings
from densetrain.planner.search import search


def test_the_emitted_job_runs_the_chunked_output_head_the_plan_assumed():
    """The plan's memory (``PlanSettings.chunked_loss``, the default) holds no [tokens, V]
    logits, so the job it emits must train with the chunked head (``loss_chunk_size`` > 0),
    as the embedded default job does; with full logits its peak would exceed the plan."""
    assert PlanSettings().chunked_loss
    cfg = ModelConfig(vocab_size=512, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      ffn_dim=128, max_seq_len=64)
    result = search(cfg, seq_len=32, global_batch=16, devices=2, cluster=get_cluster("h100"))
    job = plan_job(result.cfg, result.layout(0), seq_len=32, global_batch=16)
    assert job.training.loss_chunk_size > 0
    assert load_job_config(None).training.loss_chunk_size > 0


def test_emit_config_that_cannot_be_written_names_the_path_and_why(tmp_path, capsys):
    from densetrain.cli.main import main

    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "job.toml"
    assert main(["plan", "--model", "gpt2-124m", "--devices", "8", "--seq-len", "1024",
                 "--emit-config", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{target} cannot be written: {tmp_path / 'afile'} is a file, not a directory" in err
    assert ".tmp" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_the_emitted_job_trains_in_the_precision_the_plan_counted():
    """bf16 plans count 2-byte activations: their job trains under bf16 autocast; an fp32 plan
    trains in fp32."""
    cfg = ModelConfig(vocab_size=512, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      ffn_dim=128, max_seq_len=64)
    result = search(cfg, seq_len=32, global_batch=16, devices=2, cluster=get_cluster("h100"))
    for precision, dtype in (("bf16-mixed", "bf16"), ("fsdp2-bf16", "bf16"), ("fp32", "fp32")):
        job = plan_job(result.cfg, result.layout(0), seq_len=32, global_batch=16,
                       precision=precision)
        assert job.training.dtype == dtype
