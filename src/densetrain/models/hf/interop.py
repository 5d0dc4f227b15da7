"""Load Hugging Face checkpoints into densetrain and export densetrain models to them.

``load_hf(dir)`` reads ``config.json`` and ``model.safetensors`` (or the shards listed in
``model.safetensors.index.json``), checks every tensor name and shape against what the config
implies before loading any data, and returns a ``Transformer``. ``save_hf(model, dir)`` writes a
directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads; it validates the
config and every parameter before anything is written and writes atomically. Both directions
are lossless (renames, transposes and reshapes only).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from densetrain.errors import UserError
from densetrain.models.config import ModelConfig
from densetrain.models.hf.base import HFAdapter, Tensors
from densetrain.models.hf.bloom import BloomAdapter
from densetrain.models.hf.files import (
    DEFAULT_MAX_SHARD_BYTES,
    checkpoint_files,
    read_json,
    read_tensors,
    tensor_specs,
    weight_dtype,
    write_directory_atomically,
    write_json,
    write_safetensors,
)
from densetrain.models.hf.gpt2 import GPT2Adapter
from densetrain.models.hf.llama import LlamaAdapter, MistralAdapter, Qwen3Adapter
from densetrain.models.hf.neox import NeoXAdapter
from densetrain.models.hf.opt import OPTAdapter
from densetrain.models.hf.phi import PhiAdapter
from densetrain.models.hf.shapes import dt_param_shapes, meta_state_dict
from densetrain.models.transformer import Transformer

ADAPTERS: dict[str, HFAdapter] = {
    adapter.model_type: adapter
    for adapter in (
        GPT2Adapter(),
        LlamaAdapter(),
        MistralAdapter(),
        Qwen3Adapter(),
        NeoXAdapter(),
        OPTAdapter(),
        BloomAdapter(),
        PhiAdapter(),
    )
}
SUPPORTED_MODEL_TYPES = tuple(sorted(ADAPTERS))
_MAX_LISTED = 5


def get_adapter(model_type: str) -> HFAdapter:
    """The adapter of a Hugging Face ``model_type``; ``ValueError`` listing supported ones."""
    if model_type not in ADAPTERS:
        raise UserError(
            f"unsupported Hugging Face model_type {model_type!r}; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    return ADAPTERS[model_type]


def _adapter_for_config(hf_config: dict) -> HFAdapter:
    if "model_type" not in hf_config:
        raise UserError(
            "config.json has no 'model_type', so it is not a Hugging Face config (a densetrain "
            "model directory is read with load_model / `densetrain convert --to-hf`); "
            f"supported model types: {list(SUPPORTED_MODEL_TYPES)}"
        )
    model_type = hf_config["model_type"]
    if not isinstance(model_type, str):
        raise UserError(f"config.json model_type must be a string, one of "
                        f"{list(SUPPORTED_MODEL_TYPES)}; got {model_type!r}")
    adapter = get_adapter(model_type)
    architectures = hf_config.get("architectures") or [adapter.architecture]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise UserError(f"config.json architectures must be a list of class names such as "
                        f"[{adapter.architecture!r}], got {architectures!r}")
    unsupported = [a for a in architectures if a != adapter.architecture]
    if unsupported:
        raise UserError(
            f"unsupported architecture {unsupported[0]!r} for model_type "
            f"{adapter.model_type!r}; supported: {[adapter.architecture]} (a causal LM head)"
        )
    return adapter


def config_from_hf(hf_config: dict) -> ModelConfig:
    """``ModelConfig`` of a Hugging Face ``config.json`` dict (any supported ``model_type``)."""
    return _adapter_for_config(hf_config).config_from_hf(hf_config)


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of the Hugging Face checkpoint directory ``path``.

    ``UserError`` names ``config.json`` and the Hugging Face key that is missing, of the wrong
    JSON type or out of range (and, for a combination densetrain refuses, the keys its
    ``ModelConfig`` fields come from).
    """
    return _read_hf_config(Path(path))[1]


def _read_hf_config(directory: Path) -> tuple[HFAdapter, ModelConfig]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json; expected a Hugging Face checkpoint")
    hf_config = read_json(config_path)
    try:
        adapter = _adapter_for_config(hf_config)
    except ValueError as error:
        raise UserError(f"{config_path}: {_without_file(error)}") from None
    try:
        return adapter, adapter.config_from_hf(hf_config)
    except KeyError as error:
        raise UserError(f"{config_path} has no field {error} that a {adapter.model_type!r} "
                        "config needs") from None
    except ValueError as error:
        raise UserError(f"{config_path}: {_without_file(error)}{_hf_keys_note(error, adapter)}"
                        ) from None


def _without_file(error: Exception) -> str:
    """The message without its leading ``config.json`` (the caller names the file)."""
    text = str(error)
    for prefix in ("config.json: ", "config.json "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _hf_keys_note(error: Exception, adapter: HFAdapter) -> str:
    """For a ``ModelConfig`` error (densetrain's field names), the config keys they come from."""
    text = str(error)
    named = [f"{field} is {key}" for field, key in adapter.hf_keys.items()
             if field != key and re.search(rf"(?<![\w.]){field}(?![\w.])", text)]
    return f" (densetrain's names: {', '.join(named)} in config.json)" if named else ""


def config_to_hf(cfg: ModelConfig, family: str) -> dict:
    """Hugging Face ``config.json`` dict of ``cfg`` as ``family`` (a ``model_type``).

    Raises ``ValueError`` when the family cannot express the config (e.g. qk_norm as gpt2).
    """
    return get_adapter(family).config_to_hf(cfg)


def build_transformers_model(
    cfg: ModelConfig, family: str, *, attn_implementation: str | None = None
):
    """A randomly initialised ``transformers`` model of the same architecture as ``cfg``.

    The twin used to compare densetrain with ``transformers`` (tests, benchmarks); built from
    ``config_to_hf``, so it has exactly the shapes ``save_hf`` exports. Imports ``transformers``.
    ``attn_implementation`` None lets ``transformers`` pick (SDPA where the family supports it).
    """
    import transformers

    hf_config = dict(config_to_hf(cfg, family))
    model_type = hf_config.pop("model_type")
    hf_config.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **hf_config)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    )


# ---------------------------------------------------------------------------- load
def load_hf(path: str | Path, *, dtype: torch.dtype | None = None) -> Transformer:
    """Load a Hugging Face checkpoint directory as a densetrain ``Transformer``.

    ``dtype`` casts the weights; None keeps the stored dtype (mixed floating dtypes are all
    loaded as the widest of them; see ``files.weight_dtype``). Raises ``ValueError`` naming the
    model type, a bad ``config.json`` field, or the first missing, unexpected, mis-shaped or
    non-floating-point tensors, before loading data.
    """
    directory = Path(path)
    adapter, cfg = _read_hf_config(directory)
    files = checkpoint_files(directory)
    expected = {k: tuple(v.shape) for k, v in adapter.dt_to_hf(meta_state_dict(cfg), cfg).items()}
    expected_names = set(expected)
    specs = tensor_specs(files)
    found = {}
    for name, (shape, _) in specs.items():
        if not adapter.is_ignored(name):
            found[adapter.normalise_key(name, expected_names)] = (name, shape)
    duplicate_head = _tied_head_duplicate(cfg, adapter, expected, found)
    check_tensors(directory, expected, found)
    names = {stored for stored, _ in found.values()} | ({duplicate_head} if duplicate_head
                                                         else set())
    load_dtype = weight_dtype({name: specs[name][1] for name in names}, directory)
    stored = read_tensors(files, names)
    stored = {name: tensor.to(dtype or load_dtype) for name, tensor in stored.items()}
    state = {key: stored[name] for key, (name, _) in found.items()}
    if duplicate_head:
        _check_duplicate_head(stored[duplicate_head], state, cfg, adapter)
    return build_model(cfg, adapter.hf_to_dt(state, cfg))


def _tied_head_duplicate(
    cfg: ModelConfig, adapter: HFAdapter, expected: dict, found: dict
) -> str | None:
    """Tied checkpoints sometimes also store the head; set it aside (checked equal later)."""
    head = "lm_head.weight" if adapter.model_type != "gpt_neox" else "embed_out.weight"
    if cfg.tie_embeddings and head in found and head not in expected:
        return found.pop(head)[0]
    return None


def _check_duplicate_head(
    head: torch.Tensor, state: Tensors, cfg: ModelConfig, adapter: HFAdapter
) -> None:
    hf_names = {p.dt: p.hf for p in adapter.rename_pairs(cfg)}
    if not torch.equal(head, state[hf_names["tok_embeddings.weight"]]):
        raise UserError(
            "config.json says tie_word_embeddings=true but the checkpoint's output head differs "
            "from its token embedding"
        )


def check_tensors(directory: Path, expected: dict, found: dict) -> None:
    """Raise ``UserError`` naming missing, unexpected and mis-shaped tensors (one line: the
    first few of each, with their expected and found shapes)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(found[k][0] for k in set(found) - set(expected))
    misshaped = [
        f"{found[k][0]}: expected {list(expected[k])}, found {list(found[k][1])}"
        for k in sorted(set(expected) & set(found))
        if tuple(found[k][1]) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_first(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped tensors {_first(misshaped)}")
    if problems:
        raise UserError(f"checkpoint {directory} does not match its config.json: " +
                         "; ".join(problems))


def _first(items: list[str]) -> str:
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def build_model(cfg: ModelConfig, state: Tensors) -> Transformer:
    """A ``Transformer`` holding exactly ``state`` (names and shapes checked strictly)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {k: v.contiguous() for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


# ---------------------------------------------------------------------------- save
def save_hf(
    model: Transformer,
    path: str | Path,
    *,
    hf_family: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Export ``model`` as a Hugging Face checkpoint directory at ``path``.

    ``hf_family`` (a ``model_type``) defaults to ``model.config.extra["hf_family"]``. ``dtype``
    casts the weights (None keeps the model's). Shards past ``max_shard_bytes``. Raises
    ``ValueError`` before writing anything when the family cannot express the config or a
    parameter is missing or mis-shaped; ``FileExistsError`` for a non-empty ``path`` unless
    ``overwrite``.
    """
    cfg = model.config
    family = hf_family or cfg.extra.get("hf_family")
    if family is None:
        raise UserError(
            "the model's config names no hf_family (config.extra['hf_family']); pass hf_family, "
            f"one of {list(SUPPORTED_MODEL_TYPES)}"
        )
    adapter = get_adapter(family)
    hf_config = adapter.config_to_hf(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _check_model_state(state, cfg)
    hf_state = adapter.dt_to_hf(state, cfg)
    out_dtype = dtype or _common_dtype(hf_state)
    hf_state = {k: v.to(out_dtype).contiguous() for k, v in hf_state.items()}
    dtype_name = str(out_dtype).removeprefix("torch.")
    hf_config.update(torch_dtype=dtype_name, dtype=dtype_name)

    def fill(directory: Path) -> None:
        write_safetensors(directory, hf_state, max_shard_bytes)
        write_json(directory / "config.json", hf_config)

    write_directory_atomically(Path(path), fill, overwrite=overwrite)


def _check_model_state(state: Tensors, cfg: ModelConfig) -> None:
    expected = dt_param_shapes(cfg)
    found = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [
        f"{k}: expected {list(expected[k])}, found {list(found[k])}"
        for k in sorted(set(expected) & set(found))
        if found[k] != expected[k]
    ]
    if missing or unexpected or misshaped:
        raise ValueError(
            "model parameters do not match its config: "
            f"missing {_first(missing) or 'none'}; unexpected {_first(unexpected) or 'none'}; "
            f"mis-shaped {_first(misshaped) or 'none'}"
        )
    meta = [k for k, v in state.items() if v.is_meta]
    if meta:
        raise ValueError(f"model parameters are on the meta device (not materialised): {meta[0]}")


def _common_dtype(state: Tensors) -> torch.dtype:
    dtypes = {v.dtype for v in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"model parameters mix dtypes {sorted(map(str, dtypes))}; pass dtype")
    return dtypes.pop()
