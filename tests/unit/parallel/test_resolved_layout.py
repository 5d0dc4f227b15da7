"""`ResolvedLayout`: one layout resolved once, read by the builders.

`resolve_layout` gives the degrees, data-parallel kind, pipeline microbatches, kv split and
batch sizes the builders derived before (`ParallelDims.from_config`, `DataParallelKind.of`, the
pipeline's microbatch default, `kv_split`); `layout_reasons` refuses the layouts `check_layout`
refuses, with the same sentences; a mesh carries a layout only once it is checked; and on gloo
ranks a model and optimizer built from the run's layout are the ones built without it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from densetrain.models.config import ModelConfig
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.layout_check import (
    DataParallelKind,
    ResolvedLayout,
    check_layout,
    layout_reasons,
    resolve_layout,
)
from densetrain.parallel.mesh import ParallelDims
from densetrain.testing import run_distributed


def model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=101, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=128,
                max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def resolve(par: ParallelConfig, world: int, *, batch: int = 16, mbs: int = 1,
            model: ModelConfig | None = None, **run) -> ResolvedLayout:
    return resolve_layout(par, model or model_cfg(), world_size=world, seq_len=16,
                          global_batch_size=batch, micro_batch_size=mbs, **run)


# (parallel config, world, global batch, micro batch, kv heads,
#  expected (dp_replicate, dp_shard, cp, tp, pp), kind, local batch, microbatches, kv split)
REPRESENTATIVE = [
    (dict(), 1, 16, 2, 2, (1, 1, 1, 1, 1), "none", 16, 8, 1),
    (dict(), 8, 16, 1, 2, (1, 8, 1, 1, 1), "fsdp", 2, 2, 1),
    (dict(dp_replicate=2, dp_shard=1), 2, 16, 2, 2, (2, 1, 1, 1, 1), "ddp", 8, 4, 1),
    (dict(dp_replicate=2, dp_shard=2), 4, 16, 1, 2, (2, 2, 1, 1, 1), "hsdp", 4, 4, 1),
    (dict(zero_stage=1), 4, 16, 1, 2, (1, 4, 1, 1, 1), "zero12", 4, 4, 1),
    (dict(tp=2), 4, 16, 1, 2, (1, 2, 1, 2, 1), "fsdp", 8, 8, 2),
    (dict(tp=4, dp_shard=1), 4, 16, 1, 2, (1, 1, 1, 4, 1), "none", 16, 16, 1),
    (dict(tp=4, dp_shard=1), 4, 16, 1, 1, (1, 1, 1, 4, 1), "none", 16, 16, 1),
    (dict(pp=2, dp_shard=1), 2, 8, 2, 2, (1, 1, 1, 1, 2), "none", 8, 4, 1),
    (dict(pp=2, pp_microbatches=4), 4, 16, 1, 2, (1, 2, 1, 1, 2), "fsdp", 8, 4, 1),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, tp=2), 8, 16, 2, 2,
     (1, 2, 1, 2, 2), "fsdp", 8, 4, 2),
]


@pytest.mark.parametrize(("par", "world", "batch", "mbs", "kv", "degrees", "kind", "local",
                          "microbatches", "kv_ways"), REPRESENTATIVE,
                         ids=[str(i) for i in range(len(REPRESENTATIVE))])
def test_resolve_layout_gives_what_the_builders_derived(par, world, batch, mbs, kv, degrees,
                                                        kind, local, microbatches, kv_ways):
    cfg = ParallelConfig(**par)
    before = dataclasses.asdict(cfg)
    layout = resolve(cfg, world, batch=batch, mbs=mbs, model=model_cfg(num_kv_heads=kv))
    assert dataclasses.asdict(cfg) == before  # pure: the config is not touched
    assert (layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.pp) == degrees
    assert (layout.data_parallel, layout.local_batch, layout.microbatches, layout.kv_split) == (
        kind, local, microbatches, kv_ways)
    # the previous derivations of the same numbers
    dims = ParallelDims.from_config(cfg, world)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == degrees
    assert (layout.dp, layout.fsdp_size) == (dims.dp_size, dims.fsdp_size)
    assert layout.local_batch == dims.local_batch_size(batch)
    assert layout.data_parallel is DataParallelKind.of(
        dp_replicate=dims.dp_replicate, fsdp_size=dims.fsdp_size, zero_stage=cfg.zero_stage)
    assert (layout.zero_stage, layout.pp_schedule, layout.pp_virtual_stages) == (
        cfg.zero_stage, cfg.pp_schedule, cfg.pp_virtual_stages)
    assert layout.num_stages == cfg.pp * cfg.pp_virtual_stages
    assert layout_reasons(layout, model_cfg(num_kv_heads=kv)) == []


def test_the_layout_is_frozen():
    layout = resolve(ParallelConfig(), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 2  # type: ignore[misc]


def test_pipeline_microbatches_match_the_builders_count():
    """A run's microbatch count is the one `build.pipeline_microbatches` gave a direct caller."""
    from densetrain.parallel.build import pipeline_microbatches

    for par, world, batch, mbs in [(dict(pp=2, dp_shard=1), 2, 8, 2),
                                   (dict(pp=2, pp_microbatches=4), 4, 16, 1),
                                   (dict(pp=2, pp_schedule="gpipe", dp_shard=1), 2, 4, 4)]:
        cfg = ParallelConfig(**par)
        dims = ParallelDims.from_config(cfg, world)
        layout = resolve(cfg, world, batch=batch, mbs=mbs)
        assert layout.microbatches == pipeline_microbatches(
            cfg, dims, local_batch_size=dims.local_batch_size(batch), micro_batch_size=mbs)


def test_degrees_that_do_not_fit_the_world_are_refused():
    with pytest.raises(ValueError, match="multiply to the world size.*= 8, but world_size = 6"):
        resolve(ParallelConfig(dp_shard=2, tp=2, pp=2), 6)
    with pytest.raises(ValueError, match="do not divide the world size 6"):
        resolve(ParallelConfig(tp=4), 6)


def _unvalidated(**kw) -> SimpleNamespace:
    """A ``ParallelConfig``'s fields without its own validation (so each rule can be hit)."""
    fields = {f: getattr(ParallelConfig(), f) for f in ParallelConfig.__dataclass_fields__}
    fields.update(dp_shard=1)
    fields.update(kw)
    return SimpleNamespace(**fields)


# (layout fields, model fields, run arguments, words of the reason)
BAD = [
    (dict(tp=8), dict(num_kv_heads=4), {}, "tp=8 must divide the attention"),
    (dict(tp=2, sequence_parallel=True), {}, dict(seq=15), "sequence parallel with"),
    (dict(tp=2), {}, dict(float8=True), "float8 runs with tp=1 only"),
    (dict(pp=8), {}, {}, "8 stages exceed model.num_layers=4"),
    (dict(dp_shard=2, tp=2, zero_stage=1), {}, {}, "zero_stage=1 runs on pure"),
    (dict(dp_replicate=2, pp=2), {}, {}, "dp_replicate=2 with tp=1, pp=2"),
    (dict(dp_shard=2), {}, dict(batch=8, mbs=3), "3 x 2 = 6"),
    (dict(pp=2, pp_microbatches=3), {}, dict(batch=8), "does not split into 3 pipeline"),
    (dict(pp=4), {}, dict(batch=8, mbs=4), "needs at least pp microbatches per step, got 2"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), {}, dict(batch=5),
     "multiple of the rounds"),
    (dict(pp=2, zero_stage=2), {}, {}, "zero_stage=3 (FSDP) only"),
    (dict(pp=2), {}, dict(compile=True), "training.compile"),
    (dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2), dict(tie_embeddings=True), {},
     "V schedule holds the first and last stage"),
    (dict(pp=2), {}, dict(batch_ramp=True), "needs a constant batch"),
    (dict(pp=2, pp_layer_split=[1, 2]), {}, {}, "pp_layer_split=[1, 2]"),
]


@pytest.mark.parametrize(("par", "model_kw", "run", "words"), BAD,
                         ids=[str(i) for i in range(len(BAD))])
def test_layout_reasons_refuse_what_check_layout_refuses(par, model_kw, run, words):
    par = _unvalidated(**par)
    cfg = model_cfg(**model_kw)
    world = par.dp_replicate * par.dp_shard * par.tp * par.pp * par.cp
    seq, batch, mbs = run.pop("seq", 16), run.pop("batch", 8), run.pop("mbs", 1)
    expected = check_layout(par, cfg, seq_len=seq, global_batch_size=batch,
                            micro_batch_size=mbs, world_size=world, **run)
    layout = resolve_layout(par, cfg, world_size=world, seq_len=seq, global_batch_size=batch,
                            micro_batch_size=mbs, **run)
    found = layout_reasons(layout, cfg)
    assert found == expected
    assert any(words in r for r in found), found


@pytest.mark.parametrize("par", [dict(dp_replicate=2, pp=2), dict(dp_replicate=2, tp=2)])
def test_replicas_compose_with_tp_and_pp_under_bf16_parameters(par):
    # DDP does not compose with tp or pp; replicas of one-rank FSDP shards (the bf16-parameter
    # path, `parallelize.single_rank_fsdp`) do, and the refusal says so
    cfg, fields = model_cfg(), _unvalidated(**par)
    world = fields.dp_replicate * fields.tp * fields.pp
    refused = check_layout(fields, cfg, seq_len=16, global_batch_size=8, micro_batch_size=1,
                           world_size=world)
    assert any("runs with bf16 parameters only (training.dtype=bf16" in r for r in refused)
    assert check_layout(fields, cfg, seq_len=16, global_batch_size=8, micro_batch_size=1,
                        world_size=world, bf16_params=True) == []


def test_a_mesh_carries_only_a_checked_layout_of_its_degrees():
    cfg = ParallelConfig()
    pmesh = ParallelDims.from_config(cfg, 1).build_mesh("cpu")
    assert pmesh.layout is None
    layout = resolve(cfg, 1, batch=8, mbs=2)
    assert pmesh.with_layout(layout, model_cfg()).layout is layout
    with pytest.raises(ValueError, match="not divisible"):
        pmesh.with_layout(resolve(cfg, 1, batch=8, mbs=3), model_cfg())
    with pytest.raises(ValueError, match="are not this mesh's"):
        pmesh.with_layout(resolve(ParallelConfig(tp=2), 2), model_cfg())


def _build_both(rank: int, world: int, par: dict, cfg_dict: dict) -> dict:
    """The model, optimizer and replica axis built on a mesh carrying the run's layout, and on
    the same mesh without it (the builders' own derivation), on ``world`` gloo ranks."""
    from torch.distributed.tensor import DTensor

    from densetrain.parallel.build import build_model
    from densetrain.parallel.parallelize import build_optimizer
    from densetrain.train.sdc import replica_axis

    cfg = ParallelConfig(**par)
    model = ModelConfig.from_dict(cfg_dict)
    bare = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    layout = resolve_layout(cfg, model, world_size=world, seq_len=16, global_batch_size=8,
                            micro_batch_size=1)
    out = {}
    for name, pmesh in (("bare", bare), ("layout", bare.with_layout(layout, model))):
        laid = build_model(model, cfg, pmesh, device=torch.device("cpu"), seed=3,
                           local_batch_size=layout.local_batch, micro_batch_size=1)
        opt = build_optimizer(laid.module, pmesh, cfg,
                              lambda groups: torch.optim.AdamW(groups, lr=1e-3, foreach=False))
        out[name] = {
            "weights": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                        for n, p in laid.module.named_parameters()},
            "optimizer": type(opt).__name__,
            "replica_axis": replica_axis(pmesh, cfg),
            "microbatches": laid.pipeline.num_microbatches if laid.pipeline else None,
        }
    return out


@pytest.mark.parametrize("par", [dict(tp=2, dp_shard=2), dict(dp_shard=4, zero_stage=1),
                                 dict(dp_replicate=2, dp_shard=2),
                                 dict(pp=2, dp_shard=2)],
                         ids=["tp2_fsdp2", "zero1", "hsdp", "pp2_fsdp2"])
def test_builders_reading_the_layout_build_what_they_derived(par):
    cfg = model_cfg(num_kv_heads=2)
    for result in run_distributed(_build_both, 4, par, cfg.to_dict()):
        bare, layout = result["bare"], result["layout"]
        assert (layout["optimizer"], layout["replica_axis"], layout["microbatches"]) == (
            bare["optimizer"], bare["replica_axis"], bare["microbatches"])
        assert layout["weights"].keys() == bare["weights"].keys()
        for name, value in bare["weights"].items():
            assert torch.equal(layout["weights"][name], value), name
