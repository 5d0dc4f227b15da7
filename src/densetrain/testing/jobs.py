"""The tiny training job the trainer's tests and the parity ladder run: a 2-layer GQA model of
width 64 on a small slice of the default corpus (vocab 512), 8 sequences of 32 tokens a step."""

from __future__ import annotations

TINY_OVERRIDES = (
    "--model.dim=64",
    "--model.embed_dim=64",  # presets resolve derived widths at construction: restate them
    "--model.head_dim=16",
    "--model.num_layers=2",
    "--model.num_heads=4",
    "--model.num_kv_heads=2",
    "--model.ffn_dim=128",
    "--data.seq_len=32",
    "--data.default_max_files=40",
    "--data.default_vocab_size=512",
    "--data.default_val_fraction=0.2",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=4",
    "--training.steps=20",
    "--schedule.warmup_steps=2",
    "--optim.lr=3e-3",
    "--eval.interval=10",
    "--eval.num_batches=2",
    "--eval.sample_tokens=8",
    "--checkpoint.interval=10",
    "--logging.log_interval=1",
    "--logging.progress=false",
    "--logging.tensorboard=false",
)


def tiny_job_overrides(*, cache_dir: str, run_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The tiny job's overrides writing to ``run_dir`` with the default corpus under
    ``cache_dir``, then ``extra`` (later overrides win)."""
    return [*TINY_OVERRIDES, f"--data.cache_dir={cache_dir}", f"--logging.run_dir={run_dir}",
            *extra]
