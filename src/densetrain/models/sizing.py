"""Analytic sizes of a ``ModelConfig``: parameters, training FLOPs per token, KV-cache bytes.

The single source of these counts for MFU, the planner and the scaling tools. Everything is
computed from the config alone (no model is built); ``param_counts`` equals
``sum(p.numel() for p in Transformer(cfg).parameters())``.
"""

from __future__ import annotations

from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.values import is_int_at_least


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    """Parameter counts of a model.

    ``embedding`` counts the token embedding (all ``padded_vocab_size`` rows), the learned
    position table when there is one, and the output matrix only when it is untied.
    ``non_embedding`` is everything else (layers, norms, ``project_in/out``, an output bias):
    the N of Kaplan et al. 2020 §2.1, who exclude embeddings from the parameter count.
    """

    total: int
    embedding: int
    non_embedding: int


def _norm_params(cfg: ModelConfig) -> int:
    with_bias = cfg.norm_type == "layernorm" and cfg.norm_bias
    return cfg.dim * (2 if with_bias else 1)


def relative_position_params(cfg: ModelConfig) -> int:
    """Parameters of one layer's Transformer-XL relative positions (models/relative.py): W_R
    [q_dim, dim] and the biases u, v [q_dim]; 0 for other position encodings."""
    if cfg.position_embedding != "relative_xl":
        return 0
    return cfg.dim * cfg.q_dim + 2 * cfg.q_dim


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, MLP and their norms)."""
    attn = cfg.dim * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.dim
    if cfg.qkv_bias:
        attn += cfg.q_dim + 2 * cfg.kv_dim
    if cfg.attn_out_bias:
        attn += cfg.dim
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    attn += relative_position_params(cfg)
    up_matrices = 2 if cfg.activation == "swiglu" else 1
    mlp = (up_matrices + 1) * cfg.dim * cfg.ffn_dim
    if cfg.mlp_bias:
        mlp += up_matrices * cfg.ffn_dim + cfg.dim
    shared_norm = cfg.block_type == "parallel" and cfg.parallel_shared_norm
    norms = _norm_params(cfg) * (1 if shared_norm else 2)
    return attn + mlp + norms


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Total, embedding and non-embedding parameters of ``Transformer(cfg)`` (see ParamCounts)."""
    vocab_matrix = cfg.padded_vocab_size * cfg.embed_dim
    embedding = vocab_matrix
    if cfg.position_embedding == "learned":
        embedding += (cfg.max_seq_len + cfg.learned_pos_offset) * cfg.dim
    if not cfg.tie_embeddings:
        embedding += vocab_matrix
    non_embedding = cfg.num_layers * layer_params(cfg)
    if cfg.embedding_norm:
        non_embedding += _norm_params(cfg)
    if cfg.final_norm:
        non_embedding += _norm_params(cfg)
    if cfg.embed_dim != cfg.dim:
        non_embedding += 2 * cfg.embed_dim * cfg.dim
    if cfg.lm_head_bias:
        non_embedding += cfg.padded_vocab_size
    return ParamCounts(
        total=embedding + non_embedding, embedding=embedding, non_embedding=non_embedding
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matrix multiply per token: the non-embedding parameters plus
    the output projection over the real (unpadded) vocabulary. Embedding lookups cost no FLOPs,
    but the output layer does (for a tied model it is the embedding matrix itself).

    Transformer-XL's position parameters (``relative_position_params``) are left out: no token
    meets them in a matmul. W_R projects the T sinusoids once per forward call, whatever the
    batch (2·T·dim·q_dim FLOPs per layer and microbatch, ``relative_projection_flops``), and u,
    v are added to the queries; the per-token cost of relative attention is the position-score
    matmul, counted with the attention (``attention_flops_per_token``).
    """
    position = cfg.num_layers * relative_position_params(cfg)
    return param_counts(cfg).non_embedding - position + cfg.vocab_size * cfg.embed_dim


def _attended_keys(cfg: ModelConfig, seq_len: int) -> int:
    """Keys each query attends to in the formulas' convention (full T, not halved for the causal
    mask), capped by the sliding window."""
    if cfg.sliding_window is None:
        return seq_len
    return min(seq_len, cfg.sliding_window)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token of the attention score and value matmuls,
    all layers: PaLM's 12·L·H·Q·T (Chowdhery et al. 2022, Appendix B; QK^T and AV, 2·T·H·Q
    each forward, backward twice the forward), T capped by a sliding window.

    Transformer-XL relative positions (``relative_xl``) add a second score matmul per head,
    (q_i + v)·(W_R R)^T over the T distances T-1 .. 0 (models/relative.py): 2·T·H·Q forward per
    token and layer, and backward its two input gradients (of q + v and of the position keys
    W_R R), 4·T·H·Q: 6·L·H·Q·T in all, half as much again as the content terms, so
    18·L·H·Q·T. Like QK^T it is computed over the whole S x T (the formulas' convention does
    not halve for the causal mask; the relative shift needs every distance of every row).
    """
    _check_seq_len(seq_len)
    keys = _attended_keys(cfg, seq_len)
    matmuls = 3 if cfg.position_embedding == "relative_xl" else 2
    return float(6 * matmuls * cfg.num_layers * cfg.q_dim * keys)


def relative_projection_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of W_R applied to the T sinusoids, all layers, per forward call (one
    microbatch, whatever its batch size): 2·L·T·dim·q_dim; 0 without ``relative_xl``.

    Backward costs the same once more (the weight gradient; the sinusoids need none).
    """
    _check_seq_len(seq_len)
    if cfg.position_embedding != "relative_xl":
        return 0.0
    return float(2 * cfg.num_layers * seq_len * cfg.dim * cfg.q_dim)


def relative_projection_flops_per_token(cfg: ModelConfig, seq_len: int, micro_batch):
    """``relative_projection_flops`` spread over a microbatch's ``micro_batch`` x ``seq_len``
    tokens (forward only; ``micro_batch`` may be an array of microbatch sizes)."""
    return relative_projection_flops(cfg, seq_len) / (micro_batch * seq_len)


def flops_per_token_palm(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token as PaLM's MFU definition: 6N + 12·L·H·Q·T.

    Chowdhery et al. 2022, Appendix B: N parameters, L layers, H heads, Q head dim, T sequence
    length; the 12·L·H·Q·T term is the attention score and value matmuls (forward and
    backward). N here is ``matmul_params`` (non-embedding parameters plus the output
    projection); for PaLM 540B (tied, no position table) that is its full 540B, with which
    the paper's 46.2% MFU at 238.3k tokens/s on 6144 TPU v4 chips is reproduced (tested).
    With a sliding window, T is capped at the window.

    Transformer-XL relative positions (Gopher, Chinchilla): the attention term is
    ``attention_flops_per_token``'s 18·L·H·Q·T (the position-score matmul is work the model
    does for every token, as QK^T is), and N leaves out W_R, u and v (``matmul_params``). W_R
    meets no token: it projects T sinusoids that depend on no input, a cost per forward call
    (``relative_projection_flops``) that an implementation may pay once per step, so model
    FLOPs (which count the model, not its implementation) leave it out, as they leave out
    recompute. What a step really executes is ``flops_per_token_executed``.
    """
    return float(6 * matmul_params(cfg)) + attention_flops_per_token(cfg, seq_len)


def flops_per_token_executed(cfg: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """Training FLOPs per token that densetrain's model executes with microbatches of
    ``micro_batch`` sequences of ``seq_len`` (no recompute): the PaLM count plus, for
    ``relative_xl``, W_R's projection forward and weight gradient once per microbatch,
    2·``relative_projection_flops`` / (micro_batch·seq_len). Matmuls are counted as in
    ``flops_per_token_palm`` (N includes the norm and bias parameters, which torch's FLOP
    counter, counting matmuls only, does not see: tests/unit/models/test_sizing_relative.py)."""
    if not is_int_at_least(micro_batch, 1):
        raise UserError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    projection = 2 * relative_projection_flops_per_token(cfg, seq_len, micro_batch)
    return flops_per_token_palm(cfg, seq_len) + projection


@dataclass(frozen=True, kw_only=True)
class ChinchillaFlops:
    """Forward FLOPs per token by Hoffmann et al. 2022, Appendix F, split into its terms."""

    embeddings: float
    attention: float
    """All layers: QKV projections, key@query logits, softmax, softmax@value, output linear."""
    dense: float
    """All layers' feed-forward blocks (and project_in/out when embed_dim != dim)."""
    logits: float

    @property
    def forward(self) -> float:
        """Forward FLOPs per token (the sum of the terms)."""
        return self.embeddings + self.attention + self.dense + self.logits

    @property
    def training(self) -> float:
        """Forward + backward, the backward pass counted as twice the forward (Appendix F)."""
        return 3 * self.forward


def chinchilla_flops_breakdown(cfg: ModelConfig, seq_len: int) -> ChinchillaFlops:
    """Appendix F's forward count per token (per-sequence counts divided by ``seq_len``).

    Generalisations beyond the paper's MHA/GELU model: with GQA/MQA the K and V projections use
    ``kv_dim`` instead of H·Q; SwiGLU counts three D×F matrices instead of two; attention logits,
    softmax and reduction use the keys actually attended (capped by a sliding window). Biases,
    norms and activations are not counted, as in the paper.

    Transformer-XL relative positions are not counted either, although Chinchilla and Gopher
    used them: the appendix lists no position term, and its Table A4 ratios come out (to the
    table's two decimals) only with none (tests/unit/models/test_sizing.py, the position
    weights in N, no position FLOPs). This stays the paper's count, so for a ``relative_xl``
    model it is below the real cost by the position-score matmul, 3·2·L·T·H·Q per token in
    training (``attention_flops_per_token``), plus W_R once per microbatch; the planner and
    MFU use ``flops_per_token_palm`` and ``flops_per_token_executed``.
    """
    _check_seq_len(seq_len)
    keys = _attended_keys(cfg, seq_len)
    d, e = cfg.dim, cfg.embed_dim
    qkv = 2 * d * (cfg.q_dim + 2 * cfg.kv_dim)
    scores = 2 * keys * cfg.q_dim
    softmax = 3 * cfg.num_heads * keys
    reduction = 2 * keys * cfg.q_dim
    out_proj = 2 * cfg.q_dim * d
    matrices = 3 if cfg.activation == "swiglu" else 2
    dense = 2 * matrices * d * cfg.ffn_dim
    projections = 2 * 2 * d * e if e != d else 0
    return ChinchillaFlops(
        embeddings=float(2 * cfg.vocab_size * e),
        attention=float(cfg.num_layers * (qkv + scores + softmax + reduction + out_proj)),
        dense=float(cfg.num_layers * dense + projections),
        logits=float(2 * e * cfg.vocab_size),
    )


def flops_per_token_chinchilla(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token by Hoffmann et al. 2022, Appendix F (forward + 2× backward),
    embeddings and final logits included as the appendix lists them."""
    return chinchilla_flops_breakdown(cfg, seq_len).training


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_elem: int = 2) -> int:
    """Bytes of keys and values one token adds to the cache across all layers:
    2 · num_layers · num_kv_heads · head_dim · bytes_per_elem."""
    if bytes_per_elem <= 0:
        raise UserError(f"bytes_per_elem must be positive, got {bytes_per_elem}")
    return 2 * cfg.num_layers * cfg.kv_dim * bytes_per_elem


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise UserError(f"seq_len must be a positive integer, got {seq_len!r}")
