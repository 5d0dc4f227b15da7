"""A family of LLaMA-style model shapes, and the one nearest a target parameter count.

Shapes: width ``dim`` a multiple of 32, heads of ``head_dim`` 32 (full multi-head attention),
SwiGLU feed-forward of about 8/3·dim rounded up to a multiple of 32 (LLaMA §2.2), RMSNorm, RoPE,
untied embeddings. Parameter counts come from ``densetrain.models.sizing.param_counts``, the
single source used by MFU and the planner.

Which N: Kaplan et al. 2020 (§2.1) count non-embedding parameters; Chinchilla counts all
parameters. For the tiny models a CPU can sweep, embeddings are most of the parameters (vocab
1024 × width 64 × 2 matrices = 131k against ~100k in the blocks) and most of the compute, so
the sweep defaults to total N, for which C = 6·N·D is close to the compute really spent
(docs/scaling.md); ``param_count="non_embedding"`` gives Kaplan's convention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig

PARAM_COUNTS = ("non_embedding", "total")
DEFAULT_DIMS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 1024)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The size fields of a LLaMA-style model (everything else comes from the preset)."""

    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int

    @property
    def aspect_ratio(self) -> float:
        """dim / num_layers (Kaplan §3.1 finds loss insensitive to it over a wide range)."""
        return self.dim / self.num_layers

    def overrides(self) -> dict[str, int]:
        """``ModelConfig`` fields this shape sets, derived ones included: a preset's resolved
        ``head_dim`` and ``embed_dim`` would otherwise survive a change of ``dim``."""
        return {"dim": self.dim, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "num_kv_heads": self.num_heads, "head_dim": self.dim // self.num_heads,
                "embed_dim": self.dim, "ffn_dim": self.ffn_dim}

    def model_config(self, *, vocab_size: int, max_seq_len: int) -> ModelConfig:
        """A LLaMA-style ``ModelConfig`` of this shape."""
        return ModelConfig(vocab_size=vocab_size, max_seq_len=max_seq_len, norm_type="rmsnorm",
                           activation="swiglu", position_embedding="rope", **self.overrides())


def swiglu_ffn_dim(dim: int, multiple: int = 32) -> int:
    """8/3·dim rounded up to ``multiple`` (LLaMA's SwiGLU width keeps 12·dim² per block)."""
    return int(math.ceil(8 * dim / 3 / multiple) * multiple)


@functools.lru_cache(maxsize=4096)
def count_params(shape: ModelShape, *, vocab_size: int, max_seq_len: int, param_count: str) -> int:
    """``param_count`` ("non_embedding" or "total") parameters of ``shape`` from sizing."""
    from densetrain.models.sizing import param_counts

    if param_count not in PARAM_COUNTS:
        raise UserError(f"param_count must be one of {PARAM_COUNTS}, got {param_count!r}")
    counts = param_counts(shape.model_config(vocab_size=vocab_size, max_seq_len=max_seq_len))
    return int(counts.non_embedding if param_count == "non_embedding" else counts.total)


def candidate_shapes(*, head_dim: int = 32, max_layers: int = 24,
                     dims: tuple[int, ...] = DEFAULT_DIMS) -> list[ModelShape]:
    """Every (dim, num_layers) pair of the family with dim/num_layers between 8 and 256.

    Widths below ``head_dim`` (16 for the smallest CPU sweeps) get one head of width ``dim``.
    """
    shapes = []
    for dim in dims:
        heads = max(1, dim // head_dim)
        if dim % heads or (dim >= head_dim and dim % head_dim):
            raise UserError(f"dims must be multiples of head_dim={head_dim}, got {dim}")
        for num_layers in range(1, max_layers + 1):
            if 8 <= dim / num_layers <= 256:
                ffn_dim = swiglu_ffn_dim(dim, multiple=16 if dim < head_dim else 32)
                shapes.append(ModelShape(dim=dim, num_layers=num_layers, num_heads=heads,
                                         ffn_dim=ffn_dim))
    return shapes


def nearest_shape(
    target_params: float,
    *,
    vocab_size: int,
    max_seq_len: int,
    param_count: str = "non_embedding",
    aspect_ratio: float = 32.0,
    tolerance: float = 0.15,
    shapes: list[ModelShape] | None = None,
) -> tuple[ModelShape, int]:
    """The family shape whose parameter count is nearest ``target_params``.

    Among shapes within ``tolerance`` (relative) of the target, the one with dim/num_layers
    closest to ``aspect_ratio`` wins; if none is that close, the nearest count wins.
    Returns the shape and its parameter count.
    """
    if not target_params > 0:
        raise UserError(f"target_params must be > 0, got {target_params}")
    scored = []
    for shape in shapes if shapes is not None else candidate_shapes():
        count = count_params(shape, vocab_size=vocab_size, max_seq_len=max_seq_len,
                             param_count=param_count)
        size_error = abs(math.log(count / target_params))
        aspect_error = abs(math.log(shape.aspect_ratio / aspect_ratio))
        scored.append((size_error, aspect_error, shape, count))
    close = [s for s in scored if s[0] <= math.log1p(tolerance)]
    if close:
        best = min(close, key=lambda s: (s[1], s[0]))
    else:
        best = min(scored, key=lambda s: (s[0], s[1]))
    return best[2], best[3]
