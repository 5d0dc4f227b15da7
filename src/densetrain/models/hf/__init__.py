"""Hugging Face interop: load ``transformers`` checkpoints into densetrain and export back.

Families: gpt2, llama, mistral, qwen3, gpt_neox, opt, bloom (and phi). See ``interop`` for the
loading/saving rules and the per-family modules for the state-dict layouts.
"""

from densetrain.models.hf.interop import (
    SUPPORTED_MODEL_TYPES,
    build_transformers_model,
    config_from_hf,
    config_to_hf,
    get_adapter,
    load_hf,
    read_hf_config,
    save_hf,
)
from densetrain.models.hf.native import check_model_dir, load_model, read_model_config, save_model
from densetrain.models.hf.shapes import dt_param_shapes

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "build_transformers_model",
    "check_model_dir",
    "config_from_hf",
    "config_to_hf",
    "dt_param_shapes",
    "get_adapter",
    "load_hf",
    "load_model",
    "read_hf_config",
    "read_model_config",
    "save_hf",
    "save_model",
]
