"""A resume on another number of ranks than wrote the checkpoint (an elastic restart on fewer
nodes) is printed and recorded in ``run_history.jsonl``; the same number is not."""

from __future__ import annotations

import json

from densetrain.testing import run_distributed
from densetrain.train import train

COMMON = ["--eval.interval=0", "--eval.sample_tokens=0", "--checkpoint.interval=4",
          "--logging.plot=false"]


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> dict:
    from densetrain.config import load_job_config

    return train(load_job_config(None, overrides))


def _history(run_dir) -> list[dict]:
    path = run_dir / "run_history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_on_fewer_ranks_is_printed_and_recorded(make_job, tiny_overrides, corpus_cache,
                                                      tmp_path, capfd) -> None:
    run_dir = tmp_path / "elastic"
    overrides = tiny_overrides + COMMON + [f"--data.cache_dir={corpus_cache}",
                                           f"--logging.run_dir={run_dir}"]
    run_distributed(_train_on_rank, 2, overrides + ["--training.steps=4",
                                                    "--parallel.dp_shard=2"], timeout=300)
    assert not [e for e in _history(run_dir) if e["event"] == "world_size_changed"]

    capfd.readouterr()
    alone = make_job(*COMMON, "--training.steps=6", f"--logging.run_dir={run_dir}")
    summary = train(alone)
    err = capfd.readouterr().err
    assert summary["resumed_from"].endswith("step-00000004")
    changed = [line for line in err.splitlines() if line.startswith("world size changed")]
    assert len(changed) == 1 and "written by 2 ranks, this run has 1" in changed[0], err
    events = [e for e in _history(run_dir) if e["event"] == "world_size_changed"]
    assert [(e["step"], e["from"], e["to"]) for e in events] == [(4, 2, 1)]
