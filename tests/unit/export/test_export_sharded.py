"""Export of checkpoints saved by two gloo ranks (FSDP2 shards, tensor-parallel shards, pipeline
stages), on one process and without a process group: the result equals the one-process path
that loads the whole model (DCP resharding into a full model) and maps it with ``save_hf``."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from densetrain.testing import run_distributed

pytest.importorskip("transformers")


def _train_on_rank(rank: int, world_size: int, overrides: list[str]) -> str:
    from densetrain.config import load_job_config
    from densetrain.train import train

    return train(load_job_config(None, overrides))["checkpoint"]


@pytest.mark.parametrize("layout", [
    "--parallel.dp_shard=2",
    pytest.param("--parallel.tp=2", marks=pytest.mark.slow),
    pytest.param("--parallel.pp=2", marks=pytest.mark.slow),
])
def test_sharded_checkpoint_exports_like_the_whole_model(trained_run, run_overrides, tmp_path,
                                                         layout):
    from densetrain.eval.loading import load_for_eval
    from densetrain.export import export_to_hf
    from densetrain.models.hf import save_hf

    _, cache = trained_run
    run_dir = tmp_path / "run"
    overrides = run_overrides(str(cache), str(run_dir), layout)
    checkpoints = run_distributed(_train_on_rank, 2, overrides, timeout=240)
    assert checkpoints[0] == checkpoints[1]
    export_to_hf(run_dir, tmp_path / "streamed", max_shard_bytes=100_000)
    model, _ = load_for_eval(run_dir, device="cpu")
    save_hf(model, tmp_path / "whole")
    streamed = {}
    for path in sorted((tmp_path / "streamed").glob("model-*.safetensors")):
        streamed.update(load_file(path))
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    assert len(list((tmp_path / "streamed").glob("model-*.safetensors"))) > 1
    assert streamed.keys() == whole.keys()
    for name, tensor in whole.items():
        assert streamed[name].equal(tensor), name
    streamed_config = json.loads((tmp_path / "streamed" / "config.json").read_text())
    whole_config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert {k: streamed_config[k] for k in whole_config} == whole_config
