"""Bad layouts are rejected before any work, with an error naming the constraint; the
builders' own guards give the reasons of the same layout rules."""

from __future__ import annotations

import pytest

from densetrain.models.config import ModelConfig
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.layout_check import check_layout
from densetrain.parallel.mesh import ParallelDims
from densetrain.parallel.pipeline import bubble_fraction, layer_split, stage_ids_for_rank


def model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=101, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=128)
    base.update(kw)
    return ModelConfig(**base)


def test_dp_shard_fills_the_world():
    dims = ParallelDims.from_config(ParallelConfig(tp=2, pp=2), 16)
    assert (dims.dp_shard, dims.dp_size, dims.fsdp_size) == (4, 4, 4)
    assert dims.active_axes() == ["pp", "dp_shard", "tp"]


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match="multiply to the world size.*= 8, but world_size = 6"):
        ParallelDims.from_config(ParallelConfig(dp_shard=2, tp=2, pp=2), 6)
    with pytest.raises(ValueError, match="do not divide the world size 6"):
        ParallelDims.from_config(ParallelConfig(tp=4), 6)


def test_builders_refuse_with_the_layout_check_reasons():
    """The runtime guards of builders called directly (not through a validated job) give the
    reason of the same ``parallel.layout_check`` rule a config gets."""
    from densetrain.parallel.build import pipeline_microbatches
    from densetrain.parallel.parallelize import data_parallel_kind

    dims = ParallelDims.from_config(ParallelConfig(dp_shard=2, tp=2), 4)
    with pytest.raises(ValueError, match="zero_stage=1 runs on pure data parallel"):
        data_parallel_kind(dims, ParallelConfig(zero_stage=1))
    assert data_parallel_kind(dims, ParallelConfig()) == "fsdp"
    ddp = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=1, pp=2), 4)
    with pytest.raises(ValueError, match="dp_replicate=2 with tp=1, pp=2"):
        data_parallel_kind(ddp, ParallelConfig())
    pp = ParallelDims.from_config(ParallelConfig(pp=2, dp_shard=1), 2)
    with pytest.raises(ValueError, match="does not split into 3 pipeline microbatches"):
        pipeline_microbatches(ParallelConfig(pp=2, pp_microbatches=3), pp, local_batch_size=8,
                              micro_batch_size=1)
    with pytest.raises(ValueError, match="needs at least pp microbatches per step, got 1"):
        pipeline_microbatches(ParallelConfig(pp=2), pp, local_batch_size=4, micro_batch_size=4)
    assert pipeline_microbatches(ParallelConfig(pp=2), pp, local_batch_size=8,
                                 micro_batch_size=2) == 4


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_heads_fewer_than_tp_are_accepted(kv_heads):
    par = ParallelConfig(tp=4, dp_shard=1)
    assert check_layout(par, model_cfg(num_kv_heads=kv_heads), seq_len=16, global_batch_size=8,
                        micro_batch_size=1, world_size=4) == []


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("tp", 0, "parallel.tp must be a positive integer"),
        ("dp_shard", -2, "parallel.dp_shard must be a positive integer or -1"),
        ("zero_stage", 4, r"parallel.zero_stage must be one of \[1, 2, 3\]"),
        ("pp_schedule", "dualpipe", "parallel.pp_schedule must be one of"),
        ("activation_checkpointing", "some", "parallel.activation_checkpointing must be one of"),
        ("pp_layer_split", [2, 0], "parallel.pp_layer_split must be a list of positive"),
        ("collective_timeout_s", 0, "parallel.collective_timeout_s must be > 0"),
        ("param_dtype", "fp16", r"parallel.param_dtype must be one of \['compute', "
         r"'fp32'\], got 'fp16'"),
    ],
)
def test_config_field_errors_name_the_field(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelConfig(**{field: value})


def test_virtual_stages_need_an_interleaved_schedule():
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs an interleaved"):
        ParallelConfig(pp=2, pp_virtual_stages=2, pp_schedule="1f1b")
    with pytest.raises(ValueError, match="zbv.*pp_virtual_stages=2"):
        ParallelConfig(pp=2, pp_schedule="zbv")


def test_layer_split_balanced_given_and_rejected():
    # a remainder goes to the middle stages (the later first), then the last, never the first
    assert layer_split(10, 4, []) == [2, 3, 3, 2]
    assert layer_split(11, 4, []) == [2, 3, 3, 3]
    assert layer_split(5, 2, []) == [2, 3]
    # Llama 3 405B on 16 stages: one layer fewer on the first and the last (Dubey et al. §3.3.2)
    assert layer_split(126, 16, []) == [7] + [8] * 14 + [7]
    assert layer_split(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="summing to model.num_layers=4"):
        layer_split(4, 2, [1, 2])
    with pytest.raises(ValueError, match="8 stages exceed model.num_layers=4"):
        layer_split(4, 8, [])


def test_stage_assignment_loop_and_v_shape():
    assert stage_ids_for_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids_for_rank(1, 4, 2, "zbv") == [1, 6]


def test_bubble_fraction_formula():
    # Narayanan et al. 2021 §2.2: (p-1)/(m+p-1) of the step; interleaving v divides the bubble.
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_one_f_one_b_needs_at_least_pp_microbatches():
    with pytest.raises(ValueError, match="pp_microbatches=1 must be >= pp=2"):
        ParallelConfig(pp=2, pp_microbatches=1, pp_schedule="1f1b")
    ParallelConfig(pp=2, pp_microbatches=1, pp_schedule="gpipe")
