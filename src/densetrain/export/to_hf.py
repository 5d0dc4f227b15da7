"""``export_to_hf``: a run, checkpoint or model directory → a self-contained Hugging Face directory.

The directory holds ``config.json`` (with ``bos_token_id``/``eos_token_id``/``pad_token_id``),
``generation_config.json``, the safetensors weights (sharded past ``max_shard_bytes``) and the
run's tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``,
so ``transformers.AutoTokenizer.from_pretrained(dir)`` and
``AutoModelForCausalLM.from_pretrained(dir)`` need no other file. Tensors stream from the source
to the files: memory holds the densetrain tensors of one Hugging Face tensor at a time (q, k and v
for a fused projection), whatever the size of the model or the layout that saved it. The
directory appears atomically (temporary sibling, then rename), with umask permissions.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from densetrain.errors import UserError
from densetrain.export.sources import ExportSource, open_source
from densetrain.models.hf.files import (
    DEFAULT_MAX_SHARD_BYTES,
    StreamingSafetensorsWriter,
    TensorSpec,
    check_output_apart,
    write_directory_atomically,
    write_json,
)
from densetrain.models.hf.interop import SUPPORTED_MODEL_TYPES, get_adapter
from densetrain.models.hf.shapes import dt_param_shapes, shape_mismatches
from densetrain.models.hf.streaming import hf_tensor_shapes, iter_hf_tensors


def _check_stored_tensors(source: ExportSource) -> None:
    expected = dt_param_shapes(source.config)
    found = {name: spec.shape for name, spec in source.specs.items()}
    missing, unexpected, wrong = (sorted(names) for names in shape_mismatches(expected, found))
    misshaped = [f"{n}: config implies {list(expected[n])}, stored {list(found[n])}"
                 for n in wrong]
    if missing or unexpected or misshaped:
        raise UserError(
            f"{source.path}: the stored model tensors do not match its config: missing "
            f"{missing[:3] or 'none'}, unexpected {unexpected[:3] or 'none'}, mis-shaped "
            f"{misshaped[:3] or 'none'}"
        )


def _stored_dtype(source: ExportSource) -> torch.dtype:
    dtypes = {spec.dtype for spec in source.specs.values()}
    if len(dtypes) != 1:
        names = sorted(str(d).removeprefix("torch.") for d in dtypes)
        raise UserError(f"{source.path} stores tensors of several dtypes ({', '.join(names)}); "
                         "choose the exported one with --dtype float32, bfloat16 or float16 "
                         "(dtype= in Python)")
    return dtypes.pop()


def _special_ids(source: ExportSource) -> dict[str, int]:
    tokenizer = source.tokenizer
    if tokenizer is None:
        return {}
    if tokenizer.vocab_size > source.config.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model "
            f"{source.path} only {source.config.vocab_size}: not the model's tokenizer"
        )
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    return {key: value for key, value in ids.items() if value is not None}


def export_to_hf(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    hf_family: str | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: str | os.PathLike | None = None,
    with_tokenizer: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> dict:
    """Export the model at ``path`` (run, checkpoint or model directory) to ``out``.

    ``hf_family`` (a ``model_type``) defaults to the config's ``extra["hf_family"]``; ``dtype``
    casts the weights (None keeps the stored dtype); ``tokenizer`` overrides the one the source
    names. ``with_tokenizer`` False writes weights and configs only. Everything is checked
    (family, tensor names and shapes, tokenizer) before the first byte is written. ``out`` may
    not be, hold or lie inside the checkpoint or model directory read; a non-empty ``out``
    raises ``FileExistsError`` unless ``overwrite``, which replaces only a model directory.
    Returns a summary dict.
    """
    source = open_source(path, tokenizer=tokenizer)
    if not isinstance(source.path, str):  # a URL source (object store) cannot hold ``out``
        check_output_apart(source.path, Path(out), inside_ok=source.kind == "model")
    cfg = source.config
    family = hf_family or cfg.extra.get("hf_family")
    if family is None:
        raise UserError(
            f"the model config of {source.path} names no hf_family; pass --family, one of "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    adapter = get_adapter(family)
    hf_config = adapter.config_to_hf(cfg)
    _check_stored_tensors(source)
    if with_tokenizer and source.tokenizer is None:
        raise UserError(
            f"no tokenizer found for {source.path} (no tokenizer.json beside it); pass "
            "--tokenizer PATH, or --no-tokenizer to export the weights alone"
        )
    out_dtype = dtype or _stored_dtype(source)
    dtype_name = str(out_dtype).removeprefix("torch.")
    special = _special_ids(source)
    hf_config.update(torch_dtype=dtype_name, dtype=dtype_name, **special)
    specs = {name: TensorSpec(shape, out_dtype)
             for name, shape in hf_tensor_shapes(cfg, adapter).items()}

    def fill(directory: Path) -> None:
        with StreamingSafetensorsWriter(directory, specs, max_shard_bytes) as writer:
            for name, tensor in iter_hf_tensors(cfg, adapter, source.read, dtype=out_dtype):
                writer.write(name, tensor)
        write_json(directory / "config.json", hf_config)
        write_json(directory / "generation_config.json", {"_from_model_config": False, **special})
        if with_tokenizer:
            from densetrain.data.tokenizer import write_hf_tokenizer_files

            write_hf_tokenizer_files(source.tokenizer, directory,
                                     model_max_length=cfg.max_seq_len)

    write_directory_atomically(Path(out), fill, overwrite=overwrite)
    return {
        "source": str(source.path), "out": str(out), "family": family, "dtype": dtype_name,
        "parameters": sum(spec.numel for spec in specs.values()),
        "tokenizer": source.tokenizer.path if with_tokenizer else None,
    }

