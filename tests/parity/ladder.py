"""The parity ladder's pieces: a tiny model, fixed data, the one-process control and a
per-rank training run of any layout, returning per-step losses and full final weights."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from densetrain.models.config import ModelConfig
from densetrain.models.loss import cross_entropy_loss
from densetrain.models.transformer import Transformer
from densetrain.parallel.config import ParallelConfig
from densetrain.parallel.memory import rank_memory
from densetrain.parallel.mesh import ParallelDims, ParallelMesh
from densetrain.parallel.parallelize import build_optimizer, init_weights, parallelize

SEED = 1234
STEPS = 5
SEQ_LEN = 16
GLOBAL_BATCH = 8
LR = 3e-3
WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "module")


ARCHITECTURES: dict[str, dict] = {
    # Llama-style: RMSNorm, rope, SwiGLU, no biases, untied embeddings (the config defaults)
    "llama": {},
    # GPT-2/GPT-3-style (models/presets/gpt2.py): pre-LayerNorm with biases, learned absolute
    # positions, GELU (tanh) MLP with biases, biased attention, tied input/output embeddings
    "gpt2": dict(
        num_kv_heads=4, norm_type="layernorm", norm_bias=True, position_embedding="learned",
        qkv_bias=True, attn_out_bias=True, activation="gelu_tanh", mlp_bias=True,
        tie_embeddings=True,
    ),
    # GPT-NeoX (models/presets/neox.py): parallel attention + MLP with two LayerNorms, partial
    # rotary, GELU, biases, untied
    "neox": dict(
        norm_type="layernorm", norm_bias=True, rotary_fraction=0.25, qkv_bias=True,
        attn_out_bias=True, activation="gelu_tanh", mlp_bias=True, block_type="parallel",
    ),
    # PaLM (models/presets/palm.py): parallel block with one shared LayerNorm (no bias),
    # multi-query attention, SwiGLU, tied embeddings
    "palm": dict(
        num_kv_heads=1, norm_type="layernorm", norm_bias=False, block_type="parallel",
        parallel_shared_norm=True, tie_embeddings=True,
    ),
    # phi-1 (models/presets/phi.py): parallel block with a shared norm, biases, a biased head
    "phi": dict(
        num_kv_heads=4, norm_type="layernorm", norm_bias=True, rotary_fraction=0.5,
        qkv_bias=True, attn_out_bias=True, activation="gelu_tanh", mlp_bias=True,
        block_type="parallel", parallel_shared_norm=True, lm_head_bias=True,
    ),
    # BLOOM (models/presets/bloom.py): ALiBi, a LayerNorm after the embedding, tied
    "bloom": dict(
        num_kv_heads=4, norm_type="layernorm", norm_bias=True, position_embedding="alibi",
        embedding_norm=True, qkv_bias=True, attn_out_bias=True, activation="gelu_tanh",
        mlp_bias=True, tie_embeddings=True,
    ),
    # Qwen3 (models/presets/qwen3.py): QK-RMSNorm per head, GQA
    "qwen3": dict(qk_norm=True),
    # Gopher / Chinchilla (models/presets/gopher.py): Transformer-XL relative positions, RMSNorm,
    # GELU
    "gopher": dict(num_kv_heads=4, position_embedding="relative_xl", activation="gelu"),
}
"""The architectures the ladder's tiny model comes in (``architecture=``, a layout's ``_arch``)."""


def tiny_model_config(architecture: str = "llama", **overrides) -> ModelConfig:
    """4 layers (PP up to 4), 4 heads, vocab 101 (prime: no tp divides it, so the vocab-parallel
    embedding and head are sharded unevenly), in one of `ARCHITECTURES`: by default Llama-style
    with GQA (2 kv heads) and SwiGLU; ``overrides`` are applied last."""
    fields = dict(
        vocab_size=101, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=128,
        max_seq_len=SEQ_LEN,
    )
    fields.update(ARCHITECTURES[architecture])
    fields.update(overrides)
    return ModelConfig(**fields)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of step ``step``: (tokens, targets), a pure function of (SEED, step)."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    data = torch.randint(0, 101, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return data[:, :-1], data[:, 1:]


DOC_END_BELOW = 10
"""With ``docs``, a token id below this ends its document (about 1.6 documents end in each
16-token sequence, so documents straddle the cp chunks)."""


def document_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Document ids [B, S] of ``tokens``: a fixed set of token ids (`DOC_END_BELOW`) ends a
    document, as an EOS token does in packed pretraining data."""
    ends = (tokens < DOC_END_BELOW).long()
    return torch.cumsum(ends, dim=1) - ends


def adamw(groups) -> torch.optim.Optimizer:
    """The optimizer every layout uses (fixed hyper-parameters, no foreach/fused variance)."""
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)


def canonical(name: str) -> str:
    """Parameter name without wrapper prefixes (checkpoint, compile, DDP)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPERS)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the parameters this rank's module holds."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[canonical(name)] = value.detach().clone()
    return out


def run_control(
    steps: int = STEPS, model_overrides: dict | None = None, clip: float = 0.0,
    architecture: str = "llama", docs: bool = False,
) -> dict:
    """One process, no parallelism: the reference losses and final weights (with ``docs``,
    attention masked per document of `document_ids` and positions restarting per document)."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture, **(model_overrides or {})))
    model.init_weights(seed=SEED)
    opt = adamw(list(model.parameters()))
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = batch(step)
        docs_BS = document_ids(tokens) if docs else None
        loss = cross_entropy_loss(model(tokens, document_ids_BS=docs_BS), targets).loss
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": full_weights(model), "grad_norms": norms}


def _local_batch(pmesh: ParallelMesh, step: int):
    tokens, targets = batch(step)
    local = pmesh.dims.local_batch_size(GLOBAL_BATCH)
    start = pmesh.dp_rank * local
    return tokens[start : start + local], targets[start : start + local]


def _cp_local(pmesh: ParallelMesh, tokens, targets, docs: bool = False):
    """This cp rank's slice of the sequence, its global positions and its document ids (with
    ``docs``; else None), as the trainer's ``prepare_batch`` gives them. Positions are None
    without cp (the model derives them)."""
    from densetrain.models.transformer import document_positions

    dims = pmesh.dims
    docs_BS = document_ids(tokens) if docs else None
    if dims.cp == 1:
        return tokens, targets, None, docs_BS
    from densetrain.parallel.context import shard_sequence

    cp_rank = pmesh.local_rank("cp")
    index_1S = torch.arange(SEQ_LEN).unsqueeze(0)
    positions = document_positions(docs_BS, index_1S).expand(tokens.shape[0], -1)
    return (
        shard_sequence(tokens, cp_rank, dims.cp),
        shard_sequence(targets, cp_rank, dims.cp),
        shard_sequence(positions, cp_rank, dims.cp),
        None if docs_BS is None else shard_sequence(docs_BS, cp_rank, dims.cp),
    )


def _mean_over(value: torch.Tensor, pmesh: ParallelMesh, axis: str) -> float:
    sub = pmesh.submesh(axis)
    if sub is None:
        return value.item()
    value = value.detach().clone()
    dist.all_reduce(value, group=sub.get_group())
    return value.item() / sub.size()


@dataclass
class LayoutRun:
    """One layout's built pieces and how the ladder drives them."""

    pmesh: ParallelMesh
    model: torch.nn.Module
    opt: object
    via_compute_loss: bool
    """Take the loss through the model's chunked head (the trainer's path), not full logits."""
    clip: float
    docs: bool = False
    """Mask attention per document (`document_ids`), positions restarting per document."""


def require_runnable(cfg: ParallelConfig, model_cfg, dims: ParallelDims, *,
                     micro_batch_size: int, document_masking: bool = False) -> None:
    """Refuse a layout the trainer would refuse (``parallel.layout_check``), as a job would."""
    from densetrain.parallel.layout_check import check_layout

    reasons = check_layout(cfg, model_cfg, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH,
                           micro_batch_size=micro_batch_size, world_size=dims.world_size,
                           document_masking=document_masking)
    if reasons:
        raise ValueError(reasons[0])


def setup_layout(world: int, layout: dict, *, compile: bool = False) -> LayoutRun:
    """The tiny model and its optimizer laid out on ``layout`` (no pp)."""
    layout = dict(layout)
    via_compute_loss = layout.pop("_compute_loss", False)
    clip = layout.pop("_clip", 0.0)
    docs = layout.pop("_docs", False)
    model_cfg = tiny_model_config(layout.pop("_arch", "llama"), **layout.pop("_model", {}))
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, world)
    require_runnable(cfg, model_cfg, dims, micro_batch_size=1, document_masking=docs)
    pmesh = dims.build_mesh("cpu")
    model = parallelize(Transformer(model_cfg), pmesh, cfg, compile=compile)
    init_weights(model, SEED)
    opt = build_optimizer(model, pmesh, cfg, adamw)
    return LayoutRun(pmesh=pmesh, model=model, opt=opt, via_compute_loss=via_compute_loss,
                     clip=clip, docs=docs)


def train_steps(run: LayoutRun, steps: range, memory_at: int = -1):
    """Run ``steps`` (global step indices) and return (dp-averaged losses, memory report)."""
    model, opt = run.model, run.opt
    losses, memory = [], None
    for step in steps:
        tokens, targets = _local_batch(run.pmesh, step)
        tokens, targets, positions, docs = _cp_local(run.pmesh, tokens, targets, run.docs)
        if run.via_compute_loss:
            loss = model.compute_loss(tokens, targets, positions_BS=positions,
                                      document_ids_BS=docs, chunk_size=8).loss
        else:
            loss = cross_entropy_loss(
                model(tokens, positions_BS=positions, document_ids_BS=docs), targets).loss
        loss.backward()
        if step == memory_at:
            memory = rank_memory(model.parameters(), opt)
        if run.clip:
            opt.clip_grad_norm_(run.clip)
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over(loss, run.pmesh, "dp_cp"))
    return losses, memory


def run_layout(
    rank: int, world: int, layout: dict, steps: int = STEPS, *, compile: bool = False
) -> dict:
    """Train the tiny model on ``layout`` (ParallelConfig fields, no pp) on this rank.

    Besides ParallelConfig fields a layout may hold ``_arch`` (a key of `ARCHITECTURES`),
    ``_model`` (ModelConfig overrides), ``_compute_loss``, ``_clip`` and ``_docs`` (see
    `LayoutRun`)."""
    run = setup_layout(world, layout, compile=compile)
    start = time.perf_counter()
    losses, memory = train_steps(run, range(steps), memory_at=steps - 1)
    elapsed = time.perf_counter() - start
    after_step = rank_memory(run.model.parameters(), run.opt)
    weights = full_weights(run.model)
    return {
        "losses": losses,
        "weights": weights if rank == 0 else None,
        "memory_after_backward": memory,
        "memory_after_step": after_step,
        "seconds": elapsed,
    }


def run_checkpoint_segment(
    rank: int, world: int, layout: dict, load_dir: str | None, save_dir: str, steps: range
) -> dict:
    """Load model and optimizer from ``load_dir`` (saved on any layout) if given, train
    ``steps``, save to ``save_dir`` with torch.distributed.checkpoint (resharding on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    run = setup_layout(world, layout)
    model, opt = run.model, run.opt.torch_optimizer
    if load_dir is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=load_dir)
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    losses, _ = train_steps(run, steps)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_dir)
    weights = full_weights(model)
    return {"losses": losses, "weights": weights if rank == 0 else None}


def run_many(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    """Run several layouts one after another in the same ranks (one spawn for all)."""
    results = []
    for layout in layouts:
        results.append(run_layout(rank, world, layout))
        dist.barrier()
    return results


def _meta_model(model_cfg) -> Transformer:
    with torch.device("meta"):
        return Transformer(model_cfg)


def run_pipeline_layout(rank: int, world: int, layout: dict, steps: int = STEPS) -> dict:
    """Train the tiny model on a layout with pp > 1 (composed with tp/fsdp as given).

    Besides ParallelConfig fields a layout may hold ``_arch``, ``_model`` (as in `run_layout`)
    and ``_clip`` (clip the gradient norm, summed over the pp group, and return each step's
    norm as ``grad_norms``). With tied embeddings ``tied_copies`` holds every stage's full copy
    of the embedding matrix after training (the first stage's and the last stage's)."""
    from densetrain.optim.clipping import clip_grad_norm_
    from densetrain.parallel.layout_check import pipeline_microbatches
    from densetrain.parallel.pipeline import build_pipeline

    layout = dict(layout)
    clip = layout.pop("_clip", 0.0)
    model_cfg = tiny_model_config(layout.pop("_arch", "llama"), **layout.pop("_model", {}))
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, world)
    local = dims.local_batch_size(GLOBAL_BATCH)
    microbatches = pipeline_microbatches(cfg.pp_microbatches, cfg.pp, local, 0)
    require_runnable(cfg, model_cfg, dims, micro_batch_size=local // microbatches)
    pmesh = dims.build_mesh("cpu")
    pipe = build_pipeline(
        lambda: _meta_model(model_cfg), pmesh, cfg, num_layers=model_cfg.num_layers,
        microbatches=microbatches, init_seed=SEED, device=torch.device("cpu"),
    )
    params = [p for m in pipe.modules for p in m.parameters()]
    opt = adamw(params)
    losses, norms = [], []
    start = time.perf_counter()
    for step in range(steps):
        tokens, targets = _local_batch(pmesh, step)
        loss = pipe.step(tokens, targets)
        if clip:
            norms.append(clip_grad_norm_(params, clip, pp_group=pmesh.group("pp")).item())
        opt.step()
        opt.zero_grad()
        value = loss.detach() if loss is not None else torch.zeros(())
        dist.all_reduce(value, group=pmesh.group("pp"))
        losses.append(_mean_over(value, pmesh, "dp"))
    elapsed = time.perf_counter() - start
    weights, copies = {}, []
    for m in pipe.modules:
        weights.update(full_weights(m))
        if model_cfg.tie_embeddings and m.tok_embeddings is not None:
            copies.append(full_weights(m)["tok_embeddings.weight"])
    gathered = [None] * world
    dist.all_gather_object(gathered, (weights, copies))
    merged, all_copies = {}, []
    for part, part_copies in gathered:
        merged.update(part)
        all_copies.extend(part_copies)
    return {"losses": losses, "weights": merged if rank == 0 else None, "seconds": elapsed,
            "grad_norms": norms, "tied_copies": all_copies if rank == 0 else None}


def run_many_pipeline(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    """Run several pipeline layouts one after another in the same ranks."""
    results = []
    for layout in layouts:
        results.append(run_pipeline_layout(rank, world, layout))
        dist.barrier()
    return results
