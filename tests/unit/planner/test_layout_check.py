"""`parallel.layout_check`: each trainer rule refuses what it should, with its reason; the
vectorised form agrees with the scalar one; a runnable layout passes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from densetrain.models.config import ModelConfig
from densetrain.parallel.config import PP_SCHEDULES, ParallelConfig
from densetrain.parallel.layout_check import RULES, RunShape, check_layout, runnable_mask


def model(**kw) -> ModelConfig:
    base = dict(vocab_size=101, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=128)
    base.update(kw)
    return ModelConfig(**base)


def layout(**kw) -> SimpleNamespace:
    """A ``ParallelConfig``'s fields without its own validation (so each rule can be hit)."""
    fields = {f: getattr(ParallelConfig(), f) for f in ParallelConfig.__dataclass_fields__}
    fields.update(dp_shard=1)
    fields.update(kw)
    return SimpleNamespace(**fields)


def reasons(par, cfg=None, *, seq=16, batch=8, mbs=1, world=None, **run):
    world = world or (par.dp_replicate * max(par.dp_shard, 1) * par.tp * par.pp * par.cp)
    return check_layout(par, cfg or model(), seq_len=seq, global_batch_size=batch,
                        micro_batch_size=mbs, world_size=world, **run)


# (rule, layout fields, model fields, run arguments, words of the reason)
CASES = [
    ("virtual_stages_need_interleaved", dict(pp=2, pp_virtual_stages=2, pp_schedule="1f1b"), {},
     {}, "needs an interleaved pp_schedule"),
    ("zbv_two_stages", dict(pp=2, pp_schedule="zbv", pp_virtual_stages=1), {}, {},
     "exactly 2 stages per rank"),
    ("explicit_microbatches_fill_pipeline", dict(pp=2, pp_microbatches=1), {}, {},
     "pp_microbatches=1 must be >= pp=2"),
    ("tp_divides_heads", dict(tp=8), dict(num_kv_heads=4), {}, "tp=8 must divide the attention"),
    ("tp_and_kv_heads", dict(tp=2), dict(dim=96, num_heads=6, num_kv_heads=3, ffn_dim=192), {},
     "num_kv_heads=3"),
    ("tp_divides_ffn", dict(tp=4), dict(ffn_dim=130), {}, "must divide model.ffn_dim=130"),
    ("sp_sequence_divides", dict(tp=2, sequence_parallel=True), {}, dict(seq=15),
     "sequence parallel with parallel.tp=2"),
    ("cp_sequence_chunks", dict(cp=2), {}, dict(seq=18), "multiple of 2 x cp = 4"),
    ("float8_without_tp", dict(tp=2), {}, dict(float8=True), "float8 runs with tp=1 only"),
    ("pp_stages_have_layers", dict(pp=8), {}, {}, "8 stages exceed model.num_layers=4"),
    ("pp_stages_have_layers", dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=4),
     {}, {}, "8 stages exceed"),
    ("zero12_pure_dp", dict(dp_shard=2, tp=2, zero_stage=1), {}, {}, "zero_stage=1 runs on pure"),
    ("zero12_pure_dp", dict(dp_shard=2, dp_replicate=2, zero_stage=2), {}, {},
     "zero_stage=2 runs on pure"),
    ("zero12_pure_dp", dict(cp=2, zero_stage=1), {}, {}, "zero_stage=1 runs on pure"),
    ("ddp_without_tp_pp", dict(dp_replicate=2, tp=2), {}, {}, "dp_replicate=2 with tp=2"),
    ("ddp_without_tp_pp", dict(dp_replicate=2, pp=2), {}, {}, "dp_replicate=2 with tp=1, pp=2"),
    ("batch_splits", dict(dp_shard=4), {}, dict(batch=6), "global_batch_size=6 is not divisible"),
    ("batch_splits", dict(dp_shard=2), {}, dict(batch=8, mbs=3), "3 x 2 = 6"),
    ("pp_microbatches_divide_batch", dict(pp=2, pp_microbatches=3), {}, dict(batch=8),
     "does not split into 3 pipeline microbatches"),
    ("pp_microbatches_fill_pipeline", dict(pp=4), {}, dict(batch=8, mbs=4),
     "needs at least pp microbatches per step, got 2"),
    ("pp_interleaved_rounds", dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
     {}, dict(batch=5), "multiple of the rounds"),
    ("pp_needs_zero3", dict(pp=2, zero_stage=2), {}, {}, "zero_stage=3 (FSDP) only"),
    ("pp_without_compile", dict(pp=2), {}, dict(compile=True), "training.compile"),
    ("pp_tied_without_zbv", dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2),
     dict(tie_embeddings=True), {}, "V schedule holds the first and last stage"),
    ("pp_plain_causal", dict(pp=2), {}, dict(document_masking=True), "document_masking"),
    ("pp_constant_batch", dict(pp=2), {}, dict(batch_ramp=True), "needs a constant batch"),
]


@pytest.mark.parametrize(("rule", "par", "model_kw", "run", "words"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_refuses_with_its_reason(rule, par, model_kw, run, words):
    found = reasons(layout(**par), model(**model_kw), **run)
    assert any(words in r for r in found), found
    # The reason comes from the named rule (not from another that happens to fire too).
    by_name = {r.name: r for r in RULES}
    fields = SimpleNamespace(**vars(layout(**par)), micro_batch_size=run.get("mbs", 1))
    fields.dp = fields.dp_replicate * fields.dp_shard
    shape = RunShape(seq_len=run.get("seq", 16), global_batch_size=run.get("batch", 8),
                     world_size=1, compile=run.get("compile", False),
                     document_masking=run.get("document_masking", False),
                     batch_ramp=run.get("batch_ramp", False), float8=run.get("float8", False))
    assert by_name[rule].violated(fields, model(**model_kw), shape)


def test_every_rule_has_a_case():
    assert {r.name for r in RULES} == {c[0] for c in CASES}


@pytest.mark.parametrize("par", [
    dict(), dict(dp_shard=2), dict(dp_replicate=2), dict(tp=2, dp_shard=2),
    dict(tp=4, sequence_parallel=True), dict(cp=2, dp_shard=2),
    dict(pp=2, pp_schedule="gpipe", pp_microbatches=1),
    dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2), dict(pp=2, dp_replicate=2, dp_shard=2),
    dict(dp_shard=2, zero_stage=1),
])
def test_runnable_layouts_pass(par):
    assert reasons(layout(**par)) == []


@pytest.mark.parametrize("par", [
    dict(tp=2, sequence_parallel=False), dict(tp=2, sequence_parallel=True),
    dict(tp=2, dp_shard=2), dict(tp=4, dp_replicate=2, dp_shard=2),
])
def test_tensor_parallel_runs_gpt_architecture(par):
    """GPT-2/GPT-3: tied embeddings and learned positions under TP (with or without SP and
    FSDP), and with pipeline parallel (not the zbv schedule)."""
    gpt = model(num_kv_heads=4, position_embedding="learned", tie_embeddings=True,
                norm_type="layernorm", norm_bias=True, activation="gelu_tanh")
    assert reasons(layout(**par), gpt) == []
    assert reasons(layout(pp=2, tp=2), gpt) == []
    refused = reasons(layout(pp=2, tp=2, pp_schedule="zbv", pp_virtual_stages=2), gpt)
    assert len(refused) == 1 and "untied embeddings" in refused[0]


def test_degrees_must_multiply_to_the_world():
    assert "multiply to the world size" in reasons(layout(tp=2, dp_shard=2), world=8)[0]
    assert "do not divide the world size 6" in reasons(layout(tp=4, dp_shard=-1), world=6)[0]
    assert reasons(layout(tp=2, dp_shard=-1), world=4) == []


def test_without_a_world_size_only_what_the_config_fixes_is_checked():
    def check(par, batch, mbs=1):
        return check_layout(par, model(), seq_len=16, global_batch_size=batch,
                            micro_batch_size=mbs, world_size=None)

    # dp_shard=-1: the dp-dependent rules wait for the world size, except the batch split over
    # the part of dp the config fixes (dp_replicate=2 with 3 sequences never splits).
    assert check(layout(dp_shard=-1, pp=2, pp_microbatches=4), batch=6) == []
    assert "global_batch_size=3 is not divisible" in check(layout(dp_shard=-1, dp_replicate=2),
                                                           batch=3)[0]
    # a fixed dp_shard: the world is the product of the degrees
    assert "does not split into 4" in check(layout(dp_shard=2, pp=2, pp_microbatches=4),
                                            batch=6)[0]
    assert check(layout(tp=8, dp_shard=-1), batch=8)[0].startswith("parallel.tp=8 must divide")
    # a micro-batch size still to be derived (0) skips the rules that read it
    assert check(layout(dp_shard=2), batch=8, mbs=0) == []


def test_require_raises_the_named_rules_reason():
    from densetrain.parallel.layout_check import require

    with pytest.raises(ValueError, match="zero_stage=1 runs on pure data parallel"):
        require(("zero12_pure_dp",), layout(dp_shard=2, tp=2, zero_stage=1))
    require(("zero12_pure_dp",), layout(dp_shard=2, zero_stage=1))


def test_layer_split_must_match_the_stages():
    assert "pp_layer_split=[1, 2]" in reasons(layout(pp=2, pp_layer_split=[1, 2]))[0]
    assert reasons(layout(pp=2, pp_layer_split=[1, 3])) == []


def test_vectorised_mask_agrees_with_the_scalar_check():
    cfg = model(num_heads=8, num_kv_heads=2, dim=128, ffn_dim=256, num_layers=6)
    rows = list(itertools.product((1, 2, 4), (1, 2, 3), (1, 2), (1, 2), (1, 2, 3), PP_SCHEDULES,
                                  (1, 2), (False, True), (1, 4)))
    cols = {name: np.array(values) for name, values in zip(
        ("tp", "pp", "cp", "dp_replicate", "zero_stage", "pp_schedule", "pp_virtual_stages",
         "sequence_parallel", "micro_batch_size"), zip(*rows, strict=True), strict=True)}
    cols["dp_shard"] = np.full(len(rows), 2)
    cols["pp_microbatches"] = np.zeros(len(rows), dtype=np.int64)
    run = RunShape(seq_len=24, global_batch_size=16, world_size=0)
    mask = runnable_mask(cols, cfg, run)
    for i in range(len(rows)):
        par = layout(**{k: v[i].item() for k, v in cols.items() if k != "micro_batch_size"})
        world = par.tp * par.pp * par.cp * par.dp_replicate * par.dp_shard
        ok = not check_layout(par, cfg, seq_len=24, global_batch_size=16,
                              micro_batch_size=int(cols["micro_batch_size"][i]), world_size=world)
        assert ok == bool(mask[i]), (vars(par), mask[i])
    assert 0 < mask.sum() < len(rows)


def test_parallel_config_validation_uses_the_config_rules():
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs an interleaved"):
        ParallelConfig(pp=2, pp_virtual_stages=2, pp_schedule="gpipe")


def test_the_check_imports_no_torch():
    code = ("import sys; import densetrain.parallel.layout_check; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
