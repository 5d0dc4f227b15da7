"""The shared machinery of the per-family Hugging Face adapters.

An adapter knows one ``model_type``: how its ``config.json`` maps to a ``ModelConfig`` (and
back, refusing configs the family cannot express) and how its state-dict names and layouts map
to densetrain's (``models/transformer.py``). Most tensors are plain renames, given by
``rename_pairs``; fused or transposed layouts are handled by the ``_export_special`` /
``_import_special`` hooks. Vocabulary padding is handled here: exports carry only the
``vocab_size`` real rows, imports pad with zeros to ``padded_vocab_size``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.values import is_int_at_least

Tensors = dict[str, torch.Tensor]

# Hugging Face activation names and the densetrain activation they compute.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
# Inverse map used on export.
DT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def layernorm_mha_fields(cfg: ModelConfig) -> dict[str, object]:
    """The ``required_fields`` shared by the LayerNorm families (GPT-2, OPT, BLOOM, GPT-NeoX,
    phi): LayerNorm with bias, full-width multi-head queries, no QK-norm, no sliding window."""
    return {
        "norm_type": "layernorm",
        "norm_bias": True,
        "head_dim": cfg.dim // cfg.num_heads,
        "q_dim": cfg.dim,
        "qk_norm": False,
        "sliding_window": None,
    }


# ----------------------------------------------------------------- typed config.json reads
# Each reads one key of a Hugging Face config.json dict and checks its JSON type (and range), so
# that an error names the Hugging Face key, not the densetrain field it becomes. ``key`` may be
# a tuple of aliases (the first present one is read). A key without ``default`` is required
# (``KeyError`` naming it); ``default=None`` makes it optional, absent or null.
_REQUIRED: Any = object()

# The densetrain fields most adapters read from the same Hugging Face keys (see ``hf_keys``).
STANDARD_HF_KEYS = {
    "dim": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings",
    "rotary_fraction": "partial_rotary_factor",
}


def _lookup(hf: dict, key: str | tuple[str, ...], default: Any) -> tuple[str, Any, bool]:
    """(the key read, its value, whether to use the default instead)."""
    keys = (key,) if isinstance(key, str) else key
    present = [k for k in keys if k in hf]
    chosen = next((k for k in present if hf[k] is not None), present[0] if present else None)
    if chosen is None:
        if default is _REQUIRED:
            raise KeyError(keys[0])
        return keys[0], default, True
    if hf[chosen] is None and default is None:
        return chosen, None, True
    return chosen, hf[chosen], False


def hf_int(hf: dict, key: str | tuple[str, ...], default: Any = _REQUIRED, *,
           minimum: int = 1) -> Any:
    """``hf[key]``: a JSON integer >= ``minimum``; ``ValueError`` naming the key otherwise."""
    name, value, use_default = _lookup(hf, key, default)
    if use_default:
        return value
    if not is_int_at_least(value, minimum):
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"config.json {name} must be {wanted}, got {value!r}")
    return value


def hf_float(hf: dict, key: str | tuple[str, ...], default: Any = _REQUIRED, *,
             positive: bool = True) -> Any:
    """``hf[key]`` as a float: a finite JSON number (> 0 when ``positive``)."""
    name, value, use_default = _lookup(hf, key, default)
    if use_default:
        return value
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or (positive and value <= 0)):
        wanted = "a number > 0" if positive else "a finite number"
        raise UserError(f"config.json {name} must be {wanted}, got {value!r}")
    return float(value)


def hf_bool(hf: dict, key: str | tuple[str, ...], default: Any = _REQUIRED) -> Any:
    """``hf[key]``: a JSON boolean (``true``/``false``, not a string or a number)."""
    name, value, use_default = _lookup(hf, key, default)
    if use_default:
        return value
    if not isinstance(value, bool):
        raise UserError(f"config.json {name} must be true or false (a JSON boolean), "
                        f"got {value!r}")
    return value


def hf_str(hf: dict, key: str | tuple[str, ...], default: Any = _REQUIRED) -> Any:
    """``hf[key]``: a JSON string."""
    name, value, use_default = _lookup(hf, key, default)
    if use_default:
        return value
    if not isinstance(value, str):
        raise UserError(f"config.json {name} must be a string, got {value!r}")
    return value


@dataclass(frozen=True)
class Pair:
    """One tensor that is a plain rename (optionally transposed) between the two layouts."""

    dt: str
    hf: str
    transpose: bool = False


class HFAdapter:
    """Base class: config and state-dict mapping for one Hugging Face ``model_type``."""

    model_type: str = ""
    architecture: str = ""
    base_prefix: str = ""
    """Prefix of every non-head tensor (``model.``, ``transformer.`` ...)."""
    ignored_patterns: tuple[str, ...] = ()
    """Regexes of checkpoint entries that are buffers, not weights (skipped on import)."""
    hf_keys: dict[str, str] = STANDARD_HF_KEYS
    """The ``config.json`` key each differently named ``ModelConfig`` field is read from (named
    beside a ``ModelConfig`` error, which uses densetrain's names)."""

    # ----------------------------------------------------------------- config
    def config_from_hf(self, hf: dict) -> ModelConfig:
        """``ModelConfig`` of a Hugging Face ``config.json`` dict of this family."""
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """Hugging Face ``config.json`` dict; ``ValueError`` if the family cannot express cfg."""
        raise NotImplementedError

    def required_fields(self, cfg: ModelConfig) -> dict[str, object]:
        """``ModelConfig`` fields the family fixes, with the value it requires."""
        return {}

    def check_expressible(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` listing every field whose value this family cannot express."""
        problems = [
            f"{name}={getattr(cfg, name)!r} (needs {want!r})"
            for name, want in self.required_fields(cfg).items()
            if getattr(cfg, name) != want
        ]
        if problems:
            raise UserError(
                f"cannot export this model as Hugging Face {self.model_type!r}: "
                + "; ".join(problems)
            )

    def base_hf_config(self, cfg: ModelConfig) -> dict:
        """Entries common to every exported ``config.json``."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    # ----------------------------------------------------------------- tensors
    def rename_pairs(self, cfg: ModelConfig) -> list[Pair]:
        """Tensors that map one-to-one between the layouts."""
        raise NotImplementedError

    def _export_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        """Add the Hugging Face tensors that are not plain renames (fused layouts)."""

    def _import_special(self, state: Tensors, cfg: ModelConfig, out: Tensors) -> None:
        """Add the densetrain tensors that are not plain renames (fused layouts)."""

    def dt_to_hf(self, state: Tensors, cfg: ModelConfig) -> Tensors:
        """Map a densetrain state dict (parameter names of models/transformer.py) to HF names."""
        state = unpad_vocab(state, cfg)
        out: Tensors = {}
        for pair in self.rename_pairs(cfg):
            tensor = state[pair.dt]
            out[pair.hf] = tensor.t() if pair.transpose else tensor
        self._export_special(state, cfg, out)
        return out

    def hf_to_dt(self, state: Tensors, cfg: ModelConfig) -> Tensors:
        """Map a Hugging Face state dict (names normalised by ``normalise_key``) to densetrain."""
        out: Tensors = {}
        for pair in self.rename_pairs(cfg):
            tensor = state[pair.hf]
            out[pair.dt] = tensor.t() if pair.transpose else tensor
        self._import_special(state, cfg, out)
        return pad_vocab(out, cfg)

    def normalise_key(self, key: str, expected: set[str]) -> str:
        """The expected name of checkpoint entry ``key``: base models saved without a head omit
        (part of) ``base_prefix``, which is restored here."""
        if key in expected:
            return key
        parts = self.base_prefix.split(".")[:-1]
        for end in range(1, len(parts) + 1):
            candidate = ".".join(parts[:end]) + "." + key
            if candidate in expected:
                return candidate
        return key

    def is_ignored(self, key: str) -> bool:
        """True for checkpoint entries that are buffers (attention masks, rotary caches)."""
        return any(re.search(p, key) for p in self.ignored_patterns)


def layer_prefixes(cfg: ModelConfig, hf_layer: str) -> list[tuple[str, str]]:
    """(densetrain, Hugging Face) prefixes of every layer, e.g. ("layers.3.", "model.layers.3.")."""
    return [(f"layers.{i}.", f"{hf_layer}{i}.") for i in range(cfg.num_layers)]


def linear_pairs(dt: str, hf: str, bias: bool, transpose: bool = False) -> list[Pair]:
    """Pairs of a linear layer (weight, and bias when present)."""
    pairs = [Pair(dt + ".weight", hf + ".weight", transpose)]
    if bias:
        pairs.append(Pair(dt + ".bias", hf + ".bias"))
    return pairs


def norm_pairs(dt: str, hf: str, cfg: ModelConfig) -> list[Pair]:
    """Pairs of a norm (weight, and bias for a LayerNorm with bias)."""
    return linear_pairs(dt, hf, cfg.norm_type == "layernorm" and cfg.norm_bias)


def fuse_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Fuse q/k/v (weights [H*hd, D] or biases [H*hd]) into the per-head interleaved layout of
    GPT-NeoX and BLOOM: rows grouped as head 0 (q, k, v), head 1 (q, k, v), ..."""
    rest = q.shape[1:]
    stacked = torch.stack([t.reshape(num_heads, -1, *rest) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *rest)


def split_heads(fused: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, ...]:
    """Inverse of ``fuse_heads``: (q, k, v) from a per-head interleaved fused tensor."""
    rest = fused.shape[1:]
    grouped = fused.reshape(num_heads, 3, -1, *rest)
    return tuple(grouped[:, j].reshape(-1, *rest) for j in range(3))


_VOCAB_KEYS = ("tok_embeddings.weight", "output.weight", "output.bias")


def unpad_vocab(state: Tensors, cfg: ModelConfig) -> Tensors:
    """Drop vocabulary padding rows (exports carry only ``vocab_size`` rows)."""
    if cfg.padded_vocab_size == cfg.vocab_size:
        return state
    state = dict(state)
    for key in _VOCAB_KEYS:
        if key in state:
            state[key] = state[key][: cfg.vocab_size]
    return state


def pad_vocab(state: Tensors, cfg: ModelConfig) -> Tensors:
    """Zero-pad vocabulary rows up to ``padded_vocab_size``."""
    extra_rows = cfg.padded_vocab_size - cfg.vocab_size
    if extra_rows == 0:
        return state
    for key in _VOCAB_KEYS:
        if key in state:
            tensor = state[key]
            pad = tensor.new_zeros((extra_rows, *tensor.shape[1:]))
            state[key] = torch.cat([tensor, pad], dim=0)
    return state


def rope_from_hf(hf: dict) -> dict:
    """RoPE fields (theta, rotary fraction, Llama 3.1 scaling) from either config style:
    ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    nested: dict[str, tuple[str, Any]] = {}  # key -> (qualified name, value)
    for section in ("rope_scaling", "rope_parameters"):  # 5.x's rope_parameters wins
        value = hf.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UserError(f"config.json {section} must be an object or null, got {value!r}")
        nested.update({key: (f"{section}.{key}", item) for key, item in value.items()})
    flat = {name: item for name, item in nested.values()}

    def read(reader, key: str, top_level: str | tuple[str, ...], default: Any) -> Any:
        if key in nested:
            return reader(flat, nested[key][0], default)
        return reader(hf, top_level, default)

    fields: dict = {
        "rope_theta": read(hf_float, "rope_theta", ("rope_theta", "rotary_emb_base"), 10000.0)
    }
    fraction = read(hf_float, "partial_rotary_factor", ("partial_rotary_factor", "rotary_pct"),
                    None)
    if fraction is not None:
        fields["rotary_fraction"] = fraction
    type_key = "rope_type" if "rope_type" in nested or "type" not in nested else "type"
    rope_type = read(hf_str, type_key, "rope_type", "default")
    if rope_type == "llama3":
        section = nested[type_key][0].split(".")[0] if type_key in nested else "rope_scaling"

        def need(reader, key: str) -> Any:
            return reader(flat, nested[key][0]) if key in nested else reader({}, f"{section}.{key}")

        fields["rope_scaling"] = {
            "factor": need(hf_float, "factor"),
            "low_freq_factor": need(hf_float, "low_freq_factor"),
            "high_freq_factor": need(hf_float, "high_freq_factor"),
            "original_max_seq_len": need(hf_int, "original_max_position_embeddings"),
        }
    elif rope_type != "default":
        raise UserError(
            f"config.json rope type {rope_type!r} is not supported; allowed: 'default', 'llama3'"
        )
    return fields


def rope_to_hf(cfg: ModelConfig, *, with_fraction: bool = False) -> dict:
    """RoPE entries of an exported config, in both the 5.x and the 4.x spelling."""
    params: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy: dict = {"rope_theta": cfg.rope_theta}
    if with_fraction:
        params["partial_rotary_factor"] = cfg.rotary_fraction
    if cfg.rope_scaling is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len,
        }
        params.update(scaling)
        legacy["rope_scaling"] = scaling
    return {"rope_parameters": params, **legacy}


def activation_from_hf(name: str, field: str) -> str:
    """densetrain activation of HF activation ``name``; ``ValueError`` naming ``field``."""
    if not isinstance(name, str) or name not in HF_ACTIVATIONS:
        raise UserError(
            f"config.json {field}={name!r} is not supported; allowed: {sorted(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


def activation_to_hf(cfg: ModelConfig, family: str) -> str:
    """HF activation name of ``cfg.activation``; ``ValueError`` if the family cannot express it."""
    if cfg.activation not in DT_ACTIVATIONS:
        raise UserError(
            f"cannot export this model as Hugging Face {family!r}: activation="
            f"{cfg.activation!r} (allowed: {sorted(DT_ACTIVATIONS)})"
        )
    return DT_ACTIVATIONS[cfg.activation]
