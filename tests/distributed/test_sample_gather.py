"""The end-of-run sample's weight gathering on real gloo ranks: `LaidOutModel.gathered_state_dict`
brings the full weights to global rank 0's CPU only (FSDP, TP, and pipeline stages composed with
FSDP), bit-identical to the one-process model of the same seed, and `sample_text` skips the sample
on every rank together when rank 0 could not hold the full model."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace
from unittest import mock

import torch

from densetrain.models.config import ModelConfig
from densetrain.models.transformer import Transformer
from densetrain.testing import run_distributed

SEED = 1234
PROMPT_IDS = [5, 17, 42]
NEW_TOKENS = 6


def tiny_config() -> ModelConfig:
    """4 layers (two per pipeline stage), GQA, vocab 101 (no tp divides it: uneven shards)."""
    return ModelConfig(vocab_size=101, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       ffn_dim=128, max_seq_len=16)


def _laid_out(world: int, layout: dict):
    from densetrain.parallel.build import build_model
    from densetrain.parallel.config import ParallelConfig
    from densetrain.parallel.mesh import ParallelDims

    cfg = ParallelConfig(**layout)
    pmesh = ParallelDims.from_config(cfg, world).build_mesh("cpu")
    return build_model(tiny_config(), cfg, pmesh, device=torch.device("cpu"), seed=SEED,
                       local_batch_size=2, micro_batch_size=1)


def _gather(rank: int, world: int, layouts: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Each layout's gathered dict on this rank (one spawn for all layouts)."""
    return [_laid_out(world, layout).gathered_state_dict() for layout in layouts]


def _check_gathered(results: list[list[dict]], count: int) -> None:
    reference = Transformer(tiny_config())
    reference.init_weights(seed=SEED)
    expected = reference.state_dict()
    for index in range(count):
        gathered = results[0][index]
        assert set(gathered) == set(expected)
        for name, value in gathered.items():
            assert value.device.type == "cpu", name
            assert value.dtype == expected[name].dtype, name
            assert torch.equal(value, expected[name]), name
        for rank, per_rank in enumerate(results[1:], start=1):
            assert per_rank[index] == {}, (rank, index)


def test_gathered_state_dict_on_rank0_only_fsdp_and_tp():
    layouts = [dict(dp_shard=2), dict(dp_shard=1, tp=2)]
    _check_gathered(run_distributed(_gather, 2, layouts, timeout=120), len(layouts))


def test_gathered_state_dict_on_rank0_only_pipeline_with_fsdp():
    layouts = [dict(pp=2, dp_shard=2, pp_microbatches=2)]
    _check_gathered(run_distributed(_gather, 4, layouts, timeout=120), len(layouts))


class _Tokenizer:
    """Token ids as text: encode ignores the prompt, decode joins the ids."""

    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(PROMPT_IDS)

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def _sample(rank: int, world: int) -> dict:
    """``sample_text`` under FSDP twice: with the memory probe saying 1 KB (skipped), then with
    the real probe (the tiny model fits), and the one-process model's greedy continuation."""
    import torch.distributed as dist

    from densetrain.generate import generate
    from densetrain.train import evaluation

    model = _laid_out(world, dict(dp_shard=2))
    parts = SimpleNamespace(
        data=SimpleNamespace(tokenizer=_Tokenizer()), world_size=world, rank=rank,
        is_main=rank == 0, model=model, model_cfg=tiny_config(), device=torch.device("cpu"),
        autocast=contextlib.nullcontext, pmesh=model.pmesh,
    )
    greedy = evaluation.SampleSpec(max_new_tokens=NEW_TOKENS, temperature=0.0, top_k=0,
                                   top_p=1.0, seed=0)
    err = io.StringIO()
    small = [("available host memory", 1024)]
    with mock.patch.object(evaluation, "available_memory", lambda device: small):
        with contextlib.redirect_stderr(err):
            skipped = evaluation.sample_text(parts, PROMPT_IDS, greedy)
    dist.barrier()
    sampled = evaluation.sample_text(parts, PROMPT_IDS, greedy)
    reference = Transformer(tiny_config())
    reference.init_weights(seed=SEED)
    reference.eval()
    out = generate(reference, torch.tensor([PROMPT_IDS]), NEW_TOKENS, eos_token_id=0)
    new = out[0, len(PROMPT_IDS):].tolist()
    new = new[:new.index(0)] if 0 in new else new  # the sample ends at EOS
    return {"skipped": skipped, "err": err.getvalue(), "sampled": sampled,
            "expected": " ".join(map(str, new)),
            "needed": evaluation.full_model_bytes(parts)}


def test_sample_skipped_on_every_rank_when_the_model_does_not_fit():
    results = run_distributed(_sample, 2, timeout=120)
    needed = sum(p.numel() for p in Transformer(tiny_config()).parameters()) * 4
    assert [r["needed"] for r in results] == [needed, needed]
    assert [r["skipped"] for r in results] == ["", ""]
    lines = results[0]["err"].splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("sample skipped")
    assert f"{needed:,} bytes" in lines[0] and "1,024 bytes" in lines[0]
    assert "available host memory" in lines[0]
    assert results[1]["err"] == ""
    # With the real probe the tiny model fits: rank 0 samples what one process generates.
    assert results[0]["sampled"] == results[0]["expected"] != ""
    assert results[1]["sampled"] == ""
