"""The dense decoder-only ``Transformer``: one configurable module for every supported family.

Parameter names are the contract HF interop, tensor-parallel plans and checkpoints rely on:

| name | shape | when |
|---|---|---|
| ``tok_embeddings.weight`` | [padded_vocab, embed_dim] | always |
| ``pos_embeddings.weight`` | [max_seq_len + learned_pos_offset, dim] | learned positions |
| ``embed_norm.weight/.bias`` | [dim] | BLOOM-style embedding norm |
| ``project_in.weight``, ``project_out.weight`` | [dim, E], [E, dim] | embed_dim ≠ dim |
| ``layers.{i}.attn_norm.weight/.bias`` | [dim] | always (the shared norm of PaLM-style blocks) |
| ``layers.{i}.attn.wq/.wk/.wv.weight/.bias`` | [q_dim or kv_dim, dim] | bias if qkv_bias |
| ``layers.{i}.attn.wo.weight/.bias`` | [dim, q_dim] | bias if attn_out_bias |
| ``layers.{i}.attn.q_norm.weight``, ``k_norm.weight`` | [head_dim] | qk_norm |
| ``layers.{i}.attn.relative.pos_proj.weight`` | [q_dim, dim] | relative_xl (W_R) |
| ``layers.{i}.attn.relative.content_bias.bias``, ``.position_bias.bias`` | [q_dim] | (u, v) |
| ``layers.{i}.mlp_norm.weight/.bias`` | [dim] | sequential, or parallel with two norms |
| ``layers.{i}.mlp.w_up/w_down/w_gate.weight/.bias`` | up, gate [F, D]; down [D, F] | gate: SwiGLU |
| ``norm.weight/.bias`` | [dim] | final_norm |
| ``output.weight`` (``.bias``) | [padded_vocab, embed_dim] | untied (bias if lm_head_bias) |

``forward(tokens_BS, *, targets_BS=None, ...)`` returns logits_BSV or, with ``targets_BS``, the
``LossOutput`` of ``loss_head`` (the chunked output projection + cross-entropy with
``loss_chunk_size``, never the full logits); the loss is part of ``forward`` so that FSDP2 and
DDP hooks see it. The model never looks at its layout: ``densetrain.parallel`` sets its public
strategy points, ``Transformer.loss_head`` (a ``LossHead``), ``Transformer.compile_loss_kernel``,
``TokenEmbedding.lookup`` (an ``EmbeddingLookup``), ``TransformerBlock.join_branches`` (a
``JoinBranches``) and ``Attention.attention_fn`` (an ``AttentionFn``; default
``scaled_dot_product``).
``init_weights(seed, *, write=None)`` gives each value of a parameter from (seed, name, its index
in the full tensor) (``models/init.py``), so every layout and pipeline stage starts
bit-identical; a parallelised model passes a ``write`` that draws only the rank's own shard.

``layers`` is an ``nn.ModuleDict`` keyed "0".."L-1"; a pipeline split
may delete layers and set ``tok_embeddings``, ``norm`` and ``output`` to None, and forward skips
what is missing (a stage that does not embed tokens, ``embeds_tokens`` False, takes hidden states
[B, S, D]; one without ``output`` returns hidden states). The last stage of a tied model keeps
``tok_embeddings`` as its head's weight only (``embeds_tokens`` False).

Shape legend: B batch, S sequence, D dim, E embed_dim, V vocab_size, P padded vocab, H heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from densetrain.models.attention import Attention
from densetrain.models.config import ModelConfig
from densetrain.models.init import seeded_normal
from densetrain.models.linear import Linear, linear
from densetrain.models.loss import LossOutput, chunked_lm_loss, cross_entropy_loss
from densetrain.models.masks import AttentionMask, MaskInputs, build_attention_mask
from densetrain.models.mlp import MLP
from densetrain.models.norms import build_norm
from densetrain.models.positions import alibi_slopes, rope_cos_sin

Draw = Callable[[Sequence[torch.Tensor | None] | None], torch.Tensor]
"""``draw(index)``: a parameter's initial values at ``index`` (see `Transformer.init_weights`)."""

# Wrapper names that torch.compile, activation checkpointing and FSDP1 insert into parameter
# names; they are dropped so that a parameter's seed depends only on its place in the model.
_WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class TransformerBlock(nn.Module):
    """One decoder layer: sequential pre-/post-norm, or a parallel attention+MLP residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.parallel = config.block_type == "parallel"
        self.post_norm = config.norm_position == "post"
        self.dropout = config.dropout
        self.attn_norm = build_norm(config)
        self.attn = Attention(config)
        shared = self.parallel and config.parallel_shared_norm
        self.mlp_norm = None if shared else build_norm(config)
        self.mlp = MLP(config)
        self.join_branches: JoinBranches = join_branches
        """How a parallel block adds its two branches to the residual stream (a public strategy
        point, `JoinBranches`): tensor parallel sets one that reduces both branches' partial
        sums in one collective."""

    def _drop(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0 and self.training:
            return F.dropout(x_BSD, p=self.dropout, training=True)
        return x_BSD

    def forward(
        self,
        x_BSD: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        kv_cache=None,
    ) -> torch.Tensor:
        """Apply the layer to the residual stream ``x_BSD``; returns [B, S, D]."""
        if self.parallel:
            attn_in_BSD = self.attn_norm(x_BSD)
            mlp_in_BSD = attn_in_BSD if self.mlp_norm is None else self.mlp_norm(x_BSD)
            attn_BSD = self.attn(attn_in_BSD, rope=rope, mask=mask, kv_cache=kv_cache)
            mlp_BSD = self.mlp(mlp_in_BSD)
            return self.join_branches(x_BSD, self._drop(attn_BSD), self._drop(mlp_BSD))
        if self.post_norm:
            attn_BSD = self.attn(x_BSD, rope=rope, mask=mask, kv_cache=kv_cache)
            h_BSD = self.attn_norm(x_BSD + self._drop(attn_BSD))
            return self.mlp_norm(h_BSD + self._drop(self.mlp(h_BSD)))
        attn_BSD = self.attn(self.attn_norm(x_BSD), rope=rope, mask=mask, kv_cache=kv_cache)
        h_BSD = x_BSD + self._drop(attn_BSD)
        return h_BSD + self._drop(self.mlp(self.mlp_norm(h_BSD)))


JoinBranches = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``join(x_BSD, attn_BSD, mlp_BSD)``: a parallel block's output from its input and the outputs
of its attention and MLP branches."""


def join_branches(x_BSD: torch.Tensor, attn_BSD: torch.Tensor, mlp_BSD: torch.Tensor
                  ) -> torch.Tensor:
    """The default `JoinBranches`: ``x + attn + mlp`` (GPT-J, GPT-NeoX, PaLM)."""
    return x_BSD + attn_BSD + mlp_BSD


EmbeddingLookup = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``lookup(tokens_BS, weight_PE)``: the embedding rows of ``tokens_BS`` ([B, S, E])."""


def embedding_lookup(tokens_BS: torch.Tensor, weight_PE: torch.Tensor) -> torch.Tensor:
    """The rows of ``weight_PE`` at ``tokens_BS`` (``F.embedding``)."""
    return F.embedding(tokens_BS, weight_PE)


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` (same parameter, same values) whose lookup is a public strategy point,
    ``lookup`` (an `EmbeddingLookup`; tensor parallel sets a vocab-parallel one)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.lookup: EmbeddingLookup = embedding_lookup

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``tokens_BS``: [B, S, E]."""
        return self.lookup(tokens_BS, self.weight)


class TiedOutput(nn.Module):
    """Output head of a tied model: no weight of its own (the logits use the token embedding
    matrix), only the optional ``lm_head_bias``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bias = (
            nn.Parameter(torch.zeros(config.padded_vocab_size)) if config.lm_head_bias else None
        )


class Transformer(nn.Module):
    """Dense decoder-only transformer built from a ``ModelConfig``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = TokenEmbedding(config.padded_vocab_size, config.embed_dim)
        projected = config.embed_dim != config.dim
        self.project_in = Linear(config.embed_dim, config.dim, bias=False) if projected else None
        self.pos_embeddings = None
        if config.position_embedding == "learned":
            rows = config.max_seq_len + config.learned_pos_offset
            self.pos_embeddings = nn.Embedding(rows, config.dim)
        self.embed_norm = build_norm(config) if config.embedding_norm else None
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.num_layers)}
        )
        self.norm = build_norm(config) if config.final_norm else None
        self.project_out = (
            Linear(config.dim, config.embed_dim, bias=False) if projected else None
        )
        self.output: nn.Module | None
        if config.tie_embeddings:
            self.output = TiedOutput(config)
        else:
            self.output = nn.Linear(
                config.embed_dim, config.padded_vocab_size, bias=config.lm_head_bias
            )
        # Public strategy points that densetrain.parallel sets (the model never looks at how it
        # is laid out): the loss of the output head (tensor parallel sets a vocab-parallel one)
        # and whether the chunked loss runs its per-chunk kernel through torch.compile.
        self.loss_head: LossHead = lm_head_loss
        self.compile_loss_kernel = False
        # False on a pipeline stage after the first: its input is hidden states, and a
        # ``tok_embeddings`` it still holds (the tied head's copy) is not applied to it.
        self.embeds_tokens = True

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens_BS: torch.Tensor,
        *,
        targets_BS: torch.Tensor | None = None,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        kv_cache=None,
        loss_chunk_size: int | None = None,
    ) -> torch.Tensor | LossOutput:
        """Logits [B, S, vocab_size] for token ids [B, S] (padding rows never show), or with
        ``targets_BS`` the language-model loss (`LossOutput`) computed by ``loss_head``.

        ``document_ids_BS`` (equal within a document, documents contiguous) stops attention across
        documents and, when ``positions_BS`` is None, restarts positions at each document.
        ``kv_cache`` (from ``densetrain.generate``) is used for incremental decoding; then
        ``positions_BS`` must give the absolute positions of the new tokens. Without ``output``
        (a pipeline stage) the hidden states [B, S, D] are returned instead. The loss is part
        of ``forward`` so that wrappers acting on ``forward`` (FSDP2, DDP) see the whole step,
        and the chunked head (``loss_chunk_size``) never materialises the full logits.
        """
        hidden = self.forward_hidden(
            tokens_BS, positions_BS=positions_BS, document_ids_BS=document_ids_BS, kv_cache=kv_cache
        )
        if self.output is None:
            return hidden
        if targets_BS is not None:
            return self.loss_head(self, hidden, targets_BS, chunk_size=loss_chunk_size)
        return self.logits(hidden)

    def forward_hidden(
        self,
        tokens_BS: torch.Tensor,
        *,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        """Final-normed hidden states: the input of the output projection ([B, S, E]).

        Stages without ``norm``/``output`` return the last layer's residual stream [B, S, D].
        """
        if self.takes_tokens():
            batch, seq = tokens_BS.shape
        else:
            batch, seq = tokens_BS.shape[:2]
        device = tokens_BS.device
        index_1S = torch.arange(seq, device=device).unsqueeze(0)
        if positions_BS is None:
            positions_BS = document_positions(document_ids_BS, index_1S)
        h_BSD = self._embed(tokens_BS, positions_BS)
        rope = None
        if self.config.position_embedding == "rope":
            rope = rope_cos_sin(self.config, positions_BS, h_BSD.dtype)
        mask = self._attention_mask(index_1S, positions_BS, document_ids_BS, kv_cache, h_BSD.dtype)
        for name, layer in self.layers.items():
            layer_cache = kv_cache.layer(int(name)) if kv_cache is not None else None
            h_BSD = layer(h_BSD, rope=rope, mask=mask, kv_cache=layer_cache)
        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.project_out is not None and self.output is not None:
            h_BSD = self.project_out(h_BSD)
        return h_BSD

    def takes_tokens(self) -> bool:
        """Whether forward's input is token ids (else hidden states of an earlier stage)."""
        return self.embeds_tokens and self.tok_embeddings is not None

    def _embed(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings; identity on hidden-state stage inputs."""
        if not self.takes_tokens():
            return tokens_BS
        h_BSD = self.tok_embeddings(tokens_BS)
        if self.project_in is not None:
            h_BSD = self.project_in(h_BSD)
        if self.pos_embeddings is not None:
            h_BSD = h_BSD + self.pos_embeddings(positions_BS + self.config.learned_pos_offset)
        if self.embed_norm is not None:
            h_BSD = self.embed_norm(h_BSD)
        if self.config.dropout > 0 and self.training:
            h_BSD = F.dropout(h_BSD, p=self.config.dropout, training=True)
        return h_BSD

    def _attention_mask(
        self,
        index_1S: torch.Tensor,
        positions_BS: torch.Tensor,
        document_ids_BS: torch.Tensor | None,
        kv_cache,
        dtype: torch.dtype,
    ) -> AttentionMask:
        cfg = self.config
        slopes_H = alibi_slopes(cfg.num_heads) if cfg.position_embedding == "alibi" else None
        head_start, heads = self._held_heads()
        seq = index_1S.shape[1]
        if kv_cache is not None:
            q_index_BQ = positions_BS.expand(-1, seq) if positions_BS.dim() == 2 else positions_BS
            return build_attention_mask(
                q_index_BQ=q_index_BQ,
                k_index_BT=kv_cache.key_positions(q_index_BQ),
                sliding_window=cfg.sliding_window,
                alibi_slopes_H=slopes_H,
                dtype=dtype,
            )
        # The window is kept in the inputs even when it covers this sequence: under context
        # parallel the module sees a share of a longer one.
        inputs = MaskInputs(positions_BQ=positions_BS, document_ids_BQ=document_ids_BS,
                            sliding_window=cfg.sliding_window, alibi_slopes_H=slopes_H,
                            dtype=dtype)
        window_applies = cfg.sliding_window is not None and cfg.sliding_window < seq
        if slopes_H is None and document_ids_BS is None and not window_applies:
            return AttentionMask(is_causal=True, inputs=inputs)
        # The bias of the heads this model's attention holds (a tensor-parallel rank's share);
        # without document ids it depends on the sequence length alone, so every microbatch
        # and layer reads one tensor (`_position_mask`), as Megatron-LM builds BLOOM's ALiBi
        # once: per microbatch it was 0.875 GiB at BLOOM-176B's 112 heads and 2,048 tokens, 12
        # microbatches in flight on a first pipeline stage.
        build = functools.partial(
            build_attention_mask, q_index_BQ=index_1S, k_index_BT=index_1S,
            sliding_window=cfg.sliding_window if window_applies else None,
            q_doc_BQ=document_ids_BS, k_doc_BT=document_ids_BS,
            alibi_slopes_H=None if slopes_H is None else slopes_H[head_start:head_start + heads],
            dtype=dtype)
        if document_ids_BS is None:
            mask = self._position_mask((seq, dtype, index_1S.device, head_start, heads), build)
        else:
            mask = build().mask
        return AttentionMask(is_causal=False, mask=mask, inputs=inputs,
                             head_start=head_start if slopes_H is not None else 0)

    def _held_heads(self) -> tuple[int, int]:
        """(first head, count) of the heads this model's attention modules hold: all of them,
        or a tensor-parallel rank's block (``Attention.head_start``, ``num_heads``)."""
        for module in self.layers.modules():  # blocks may be wrapped (checkpointing)
            if isinstance(module, Attention):
                return module.head_start, module.num_heads
        return 0, self.config.num_heads

    def _position_mask(self, key: tuple, build: Callable[[], AttentionMask]) -> torch.Tensor:
        """The mask that depends on positions only (ALiBi, a window), built once per ``key``
        (sequence length, dtype, device, heads) and reused; no gradient flows into it."""
        cached = getattr(self, "_mask_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, build().mask)
            self._mask_cache = cached
        return cached[1]

    # ------------------------------------------------------------------ output and loss
    def output_weight(self) -> torch.Tensor:
        """The [P, E] matrix that maps hidden states to logits (the embedding when tied)."""
        if isinstance(self.output, TiedOutput):
            if self.tok_embeddings is None:
                raise RuntimeError("tied output head without tok_embeddings")
            return self.tok_embeddings.weight
        if self.output is None:
            raise RuntimeError("this model has no output head (output is None)")
        return self.output.weight

    def logits(self, hidden_BSE: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, vocab_size] from ``forward_hidden`` output (padding rows sliced off)."""
        logits_BSP = linear(hidden_BSE, self.output_weight(), self.output.bias)
        return logits_BSP[..., : self.config.vocab_size]

    def compute_loss(
        self,
        tokens_BS: torch.Tensor,
        targets_BS: torch.Tensor,
        *,
        positions_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> LossOutput:
        """Language-model loss with the config's ``ignore_index`` and ``z_loss_coef``: the same
        as ``self(tokens_BS, targets_BS=targets_BS, ...)`` (it goes through ``forward``).

        With ``chunk_size`` the output projection and cross-entropy run ``chunk_size`` tokens at
        a time and full logits are never materialised (forward or backward).
        """
        return self(
            tokens_BS, targets_BS=targets_BS, positions_BS=positions_BS,
            document_ids_BS=document_ids_BS, loss_chunk_size=chunk_size,
        )

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        *,
        write: Callable[[torch.Tensor, Draw], None] | None = None,
    ) -> None:
        """Initialise every parameter, each from its own generator seeded by (seed, name).

        normal(0, init_std) for linear and embedding weights, with residual output projections
        (``attn.wo``, ``mlp.w_down``) scaled by 1/sqrt(2·num_layers) when
        ``scale_residual_init`` (GPT-2, Radford et al. 2019 §2.3); zeros for biases; ones for
        norm weights. Each value is a function of (seed, name, its index in the full tensor)
        (`models.init`), drawn on the CPU in fp32 and copied, so it is bit-identical for a seed
        on any device, in any construction order, for a pipeline stage holding only some of the
        layers and for a rank holding any shard. Works after a meta build and ``to_empty()``.

        ``write(param, draw)`` stores values into a parameter, where ``draw(index)`` returns the
        fp32 values of the full tensor at ``index`` (per dimension, the positions wanted, or
        None for all; `models.init.seeded_normal`); the default writes the whole tensor. A
        parallelised model, whose parameters are shards, passes a writer that draws only this
        rank's shard (``densetrain.parallel.parallelize.init_weights``), so that this module
        stays free of distributed code.
        """
        write = write or _copy_full
        cfg = self.config
        residual_std = cfg.init_std
        if cfg.scale_residual_init:
            residual_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = canonical_name(f"{module_name}.{param_name}" if module_name else param_name)
                if param_name == "bias":
                    param.zero_()
                elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                    param.fill_(1.0)
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    is_residual = name.endswith(("attn.wo.weight", "mlp.w_down.weight"))
                    std = residual_std if is_residual else cfg.init_std
                    write(param, functools.partial(seeded_normal, tuple(param.shape), std,
                                                   seed, name))
                else:
                    raise RuntimeError(f"no initialisation rule for parameter {name}")


class LossHead(Protocol):
    """``loss_head(model, hidden_BSE, targets_BS, *, chunk_size) -> LossOutput``: the loss of the
    model's output head over the final hidden states (a public strategy point of `Transformer`).
    """

    def __call__(
        self,
        model: Transformer,
        hidden_BSE: torch.Tensor,
        targets_BS: torch.Tensor,
        *,
        chunk_size: int | None,
    ) -> LossOutput: ...


def lm_head_loss(
    model: Transformer,
    hidden_BSE: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    chunk_size: int | None,
) -> LossOutput:
    """The default `LossHead`: cross-entropy (+ z-loss) of the full logits, or with
    ``chunk_size`` the chunked head that never materialises them (`chunked_lm_loss`)."""
    cfg = model.config
    if chunk_size is None:
        return cross_entropy_loss(
            model.logits(hidden_BSE),
            targets_BS,
            ignore_index=cfg.ignore_index,
            z_loss_coef=cfg.z_loss_coef,
        )
    return chunked_lm_loss(
        hidden_BSE,
        model.output_weight(),
        targets_BS,
        vocab_size=cfg.vocab_size,
        chunk_size=chunk_size,
        ignore_index=cfg.ignore_index,
        z_loss_coef=cfg.z_loss_coef,
        output_bias_P=model.output.bias,
        compiled=model.compile_loss_kernel,
    )


def _copy_full(param: torch.Tensor, draw: Draw) -> None:
    param.copy_(draw(None))


def canonical_name(name: str) -> str:
    """``name`` (a parameter's, under the model) without the names that wrappers insert
    (torch.compile, activation checkpointing, FSDP1): its place in the model alone."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def document_positions(
    document_ids_BS: torch.Tensor | None, index_1S: torch.Tensor
) -> torch.Tensor:
    """Positions 0..S-1, restarting at every change of document id when ids are given (what
    ``forward`` uses without ``positions_BS``; context parallel computes them over the whole
    sequence before sharding it)."""
    if document_ids_BS is None:
        return index_1S
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_index_BS = torch.where(starts_BS, index_1S, torch.zeros_like(index_1S))
    start_index_BS = torch.cummax(start_index_BS, dim=1).values
    return index_1S - start_index_BS
