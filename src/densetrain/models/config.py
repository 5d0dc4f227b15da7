"""`ModelConfig`: every architectural switch of the dense decoder, validated on construction.

One configurable decoder covers GPT-2/3, OPT, BLOOM, GPT-NeoX, LLaMA 1/2/3, Mistral, Qwen3, PaLM,
Gopher/Chinchilla and phi-1; the families differ only by the values of these fields. Sizes
left ``None`` are derived on construction and derived again by ``replace()``; a bad value raises
``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from densetrain.errors import UserError

NORM_TYPES = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("rope", "learned", "alibi", "relative_xl", "none")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")
BLOCK_TYPES = ("sequential", "parallel")
NORM_POSITIONS = ("pre", "post")
_DERIVED_FIELDS = ("num_kv_heads", "head_dim", "ffn_dim", "embed_dim")


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (``rope_type="llama3"`` in Hugging Face configs).

    Wavelengths longer than ``original_max_seq_len / low_freq_factor`` are divided by ``factor``;
    shorter than ``original_max_seq_len / high_freq_factor`` are kept; in between they are
    interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        if self.factor <= 0:
            raise UserError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise UserError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_seq_len <= 0:
            raise UserError(
                f"rope_scaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}"
            )


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of a dense decoder-only transformer.

    Derived sizes (``num_kv_heads``, ``head_dim``, ``ffn_dim``) may be left ``None`` and are
    resolved by ``__post_init__``; after construction every field holds a concrete value.
    """

    # --- sizes ---
    vocab_size: int
    """Number of token ids the tokenizer produces (logits a user sees have this width)."""
    dim: int
    """Residual stream width (d_model)."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads: ``num_heads`` is MHA, 1 is MQA, in between is GQA. None means num_heads."""
    head_dim: int | None = None
    """Per-head width; None means dim // num_heads. Qwen3 sets it independently of dim."""
    ffn_dim: int | None = None
    """Hidden width of the feed-forward block; None means 4 * dim."""
    max_seq_len: int = 2048
    """Longest sequence (sizes learned position tables, RoPE caches)."""
    embed_dim: int | None = None
    """Width of token embeddings when it differs from ``dim`` (OPT-350m's 512 projected to 1024);
    None means dim. When set, project_in/project_out linear maps (no bias) are added."""

    # --- normalisation ---
    norm_type: str = "rmsnorm"
    """"layernorm" (GPT-2, OPT, BLOOM, NeoX, PaLM) or "rmsnorm" (LLaMA, Mistral, Qwen3)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (QK-norm included)."""
    norm_bias: bool = False
    """LayerNorm with a bias (GPT-2, OPT, BLOOM, NeoX); ignored for RMSNorm."""
    norm_position: str = "pre"
    """"pre" (GPT-2 onwards) or "post" (original transformer; OPT-350m)."""
    embedding_norm: bool = False
    """LayerNorm right after the token embedding (BLOOM)."""
    final_norm: bool = True
    """Norm after the last layer (``norm``); False for post-norm models such as OPT-350m."""

    # --- positions ---
    position_embedding: str = "rope"
    """"rope", "learned" (absolute table: GPT-2, OPT), "alibi" (BLOOM), "relative_xl"
    (Transformer-XL relative positions: Gopher, Chinchilla; see ``models/relative.py``) or
    "none"."""
    learned_pos_offset: int = 0
    """Rows skipped at the start of the learned position table (OPT uses 2)."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies are rope_theta^(-2i/rotary_dim)."""
    rotary_fraction: float = 1.0
    """Share of each head's dims that are rotated (GPT-NeoX 0.25, phi-1 0.5)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling, or None."""

    # --- attention ---
    qkv_bias: bool = False
    """Biases on the query, key and value projections (GPT-2, NeoX, BLOOM, OPT, Qwen2)."""
    attn_out_bias: bool = False
    """Bias on the attention output projection ``wo``."""
    qk_norm: bool = False
    """RMSNorm over head_dim applied to queries and keys before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Each query attends to at most this many most recent positions, itself included (Mistral)."""

    # --- feed-forward ---
    activation: str = "swiglu"
    """"gelu" (exact erf), "gelu_tanh" (GPT-2's approximation), "relu" (OPT) or "swiglu"."""
    mlp_bias: bool = False
    """Biases on the feed-forward projections."""

    # --- block ---
    block_type: str = "sequential"
    """"sequential": x + attn(norm(x)), then + mlp(norm(.)).
    "parallel": x + attn(n1(x)) + mlp(n2(x))."""
    parallel_shared_norm: bool = False
    """With block_type="parallel": one norm feeds both branches (PaLM, phi-1) instead of two
    (NeoX)."""

    # --- embeddings / head ---
    tie_embeddings: bool = False
    """Logits use ``tok_embeddings.weight``; there is no ``output.weight``."""
    lm_head_bias: bool = False
    """Bias on the output projection (phi-1)."""
    vocab_pad_multiple: int = 1
    """Embedding and output rows are padded to a multiple of this; padded logits are never shown."""

    # --- initialisation ---
    init_std: float = 0.02
    """Std of the normal initialisation of linear and embedding weights."""
    scale_residual_init: bool = True
    """Scale the std of residual output projections by 1/sqrt(2 * num_layers) (GPT-2)."""

    # --- loss ---
    z_loss_coef: float = 0.0
    """Weight of PaLM's auxiliary z-loss, coef * log(Z)^2 (PaLM uses 1e-4)."""
    ignore_index: int = -100
    """Target id that is left out of the loss (and of its token count)."""

    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (0 for pretraining at scale)."""

    extra: dict = field(default_factory=dict)
    """Free-form provenance (e.g. the source family name); not used by the model."""

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        # Remember which sizes were derived rather than given, so that ``replace(dim=...)``
        # derives them again instead of keeping values computed from the old sizes.
        self._derived = frozenset(name for name in _DERIVED_FIELDS if getattr(self, name) is None)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None and self.num_heads > 0 and self.dim % self.num_heads == 0:
            self.head_dim = self.dim // self.num_heads
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim
        if self.embed_dim is None:
            self.embed_dim = self.dim
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and what is allowed when the config is invalid."""
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        _choice("norm_type", self.norm_type, NORM_TYPES)
        _choice("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("block_type", self.block_type, BLOCK_TYPES)
        _choice("norm_position", self.norm_position, NORM_POSITIONS)
        if self.head_dim is None:
            raise UserError(
                f"num_heads ({self.num_heads}) must divide dim ({self.dim}) when head_dim is "
                "unset; set head_dim explicitly or choose num_heads dividing dim"
            )
        if self.head_dim <= 0:
            raise UserError(f"head_dim must be positive, got {self.head_dim}")
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads <= 0:
            raise UserError(f"num_kv_heads must be a positive integer, got {self.num_kv_heads!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise UserError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}); "
                "allowed: any divisor (1 = MQA, num_heads = MHA)"
            )
        if self.embed_dim <= 0:
            raise UserError(f"embed_dim must be positive, got {self.embed_dim}")
        if self.norm_eps <= 0:
            raise UserError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.position_embedding == "rope":
            if not 0 < self.rotary_fraction <= 1:
                raise UserError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
            if self.rotary_dim % 2 != 0 or self.rotary_dim <= 0:
                raise UserError(
                    f"rotary dims (head_dim {self.head_dim} * rotary_fraction "
                    f"{self.rotary_fraction} = {self.rotary_dim}) must be even and positive"
                )
            if self.rope_theta <= 0:
                raise UserError(f"rope_theta must be > 0, got {self.rope_theta}")
            if self.rope_scaling is not None:
                self.rope_scaling.validate()
        if self.position_embedding == "relative_xl":
            _check_relative_xl(self)
        if self.learned_pos_offset < 0:
            raise UserError(f"learned_pos_offset must be >= 0, got {self.learned_pos_offset}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UserError(
                f"sliding_window must be a positive number of positions or None, "
                f"got {self.sliding_window}"
            )
        if self.vocab_pad_multiple <= 0:
            raise UserError(f"vocab_pad_multiple must be >= 1, got {self.vocab_pad_multiple}")
        if self.init_std <= 0:
            raise UserError(f"init_std must be > 0, got {self.init_std}")
        if self.z_loss_coef < 0:
            raise UserError(f"z_loss_coef must be >= 0, got {self.z_loss_coef}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.parallel_shared_norm and self.block_type != "parallel":
            raise UserError('parallel_shared_norm=True requires block_type="parallel"')
        if self.norm_position == "post" and self.block_type == "parallel":
            raise UserError('norm_position="post" is only defined for block_type="sequential"')

    # ------------------------------------------------------------------ derived sizes
    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding/output matrices: vocab_size rounded up to vocab_pad_multiple."""
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dims per head (0 without RoPE)."""
        if self.position_embedding != "rope":
            return 0
        return int(round(self.head_dim * self.rotary_fraction))

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> ModelConfig:
        """Return a copy with ``changes`` applied (validated).

        Sizes that were derived (``num_kv_heads``, ``head_dim``, ``ffn_dim``, ``embed_dim`` left
        ``None``) are derived again from the new values unless ``changes`` sets them.
        """
        rederive = {name: None for name in getattr(self, "_derived", ()) if name not in changes}
        return dataclasses.replace(self, **rederive, **changes)

    def to_dict(self) -> dict:
        """Plain-dict form (JSON/TOML friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, source: str | None = None) -> ModelConfig:
        """Build from ``to_dict`` output (e.g. a model directory's ``config.json``).

        Every key is checked: required fields present, no unknown keys (with close matches),
        each value of its field's JSON type (no strings parsed as numbers; ``rope_scaling`` an
        object of its own fields or null), then the ranges of ``validate``. ``UserError``
        (a ``ValueError``) names the field, prefixed with ``source`` (the file) when given.
        """
        from densetrain.coerce import coerce_dataclass
        from densetrain.errors import UserError

        where = f"{source}: " if source else ""
        if not isinstance(data, dict):
            raise UserError(f"{where}expected an object of ModelConfig fields, got a "
                            f"{type(data).__name__}")
        try:
            return coerce_dataclass(data, cls, "", strict=True)
        except ValueError as error:
            raise UserError(f"{where}{error}") from None


def _check_relative_xl(cfg: ModelConfig) -> None:
    if cfg.dim % 2 != 0:
        raise UserError(f'position_embedding="relative_xl" needs an even dim, got {cfg.dim}')
    if cfg.sliding_window is not None:
        raise UserError(
            'position_embedding="relative_xl" does not combine with sliding_window (a rolling '
            f"KV cache has no key order to shift by); got sliding_window={cfg.sliding_window}"
        )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} must be one of {list(allowed)}, got {value!r}")
