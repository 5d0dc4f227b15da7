"""Sub-commands `densetrain convert`, `densetrain model-info` and `densetrain presets`.

``densetrain convert --from-hf DIR --out PATH`` reads a Hugging Face checkpoint directory
(``config.json`` + safetensors, sharded or not) and writes a densetrain model directory at PATH:
``config.json`` holding ``ModelConfig.to_dict()`` and ``model.safetensors`` holding the
``Transformer`` state dict under densetrain's parameter names.
``densetrain convert --to-hf SOURCE --out DIR`` is ``densetrain export SOURCE --to-hf DIR``
under its older name: SOURCE may be a run directory, a training checkpoint or a densetrain model
directory, and DIR gets weights, configs and tokenizer files that ``transformers`` loads.
``densetrain model-info PRESET [--json]`` prints parameter counts, training FLOPs per token
(PaLM's 6N + 12·L·H·Q·T and Chinchilla's Appendix F count) and KV-cache bytes per token; PRESET
may also be a densetrain model directory or a Hugging Face checkpoint directory.
``densetrain presets [--family F]`` lists the presets with their parameter counts.
"""

from __future__ import annotations

import argparse
import json

from densetrain.errors import UserError
from densetrain.values import is_int_at_least


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def _convert(args: argparse.Namespace) -> int:
    if args.to_hf:
        from densetrain.cli.export_cmd import run_export

        return run_export(args, args.to_hf, args.out, "convert")
    from pathlib import Path

    from densetrain.models.hf import load_hf, save_model
    from densetrain.models.hf.files import check_output_apart

    check_output_apart(Path(args.from_hf), Path(args.out), inside_ok=True)
    # load_hf refuses damaged files and NaN/inf weights; errors go to the CLI's one boundary
    model = load_hf(args.from_hf, dtype=_torch_dtype(args.dtype))
    save_model(model, args.out, max_shard_bytes=int(args.max_shard_gb * 10**9),
               overwrite=args.overwrite)
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(f"converted {args.from_hf} -> {args.out} ({params:,} parameters, {dtype})")
    return 0


def model_info(name_or_path: str, *, seq_len: int | None = None, kv_bytes: int = 2) -> dict:
    """Sizes of a preset (or of the ``config.json`` in a model directory) as a plain dict."""
    from densetrain.models import sizing

    if not is_int_at_least(kv_bytes, 1):
        raise UserError(f"--kv-bytes must be a positive integer (bytes per KV-cache element: 2 "
                        f"for bf16, 1 for fp8; default 2), got {kv_bytes!r}")
    cfg = _model_config(name_or_path)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                or seq_len < 1):
        raise UserError(f"--seq-len must be a positive integer (default: the model's "
                        f"max_seq_len {cfg.max_seq_len}), got {seq_len!r}")
    seq = seq_len or cfg.max_seq_len
    counts = sizing.param_counts(cfg)
    return {
        "model": name_or_path,
        "family": cfg.extra.get("family"),
        "published_params": cfg.extra.get("published_params"),
        "total_params": counts.total,
        "non_embedding_params": counts.non_embedding,
        "embedding_params": counts.embedding,
        "seq_len": seq,
        "flops_per_token_palm": sizing.flops_per_token_palm(cfg, seq),
        "flops_per_token_chinchilla": sizing.flops_per_token_chinchilla(cfg, seq),
        "kv_cache_bytes_per_token": sizing.kv_cache_bytes_per_token(cfg, kv_bytes),
        "kv_cache_bytes_per_elem": kv_bytes,
        "config": cfg.to_dict(),
    }


_ACCEPTS = ("model-info takes a preset name (`densetrain presets` lists them), a densetrain "
            "model directory (written by `densetrain convert --from-hf`) or a Hugging Face "
            "checkpoint directory (each holding config.json)")


def _model_config(name_or_path: str):
    """The ``ModelConfig`` of a preset name, or of a model directory (or its config.json)."""
    from pathlib import Path

    from densetrain.models.presets import get_preset, list_presets

    path = Path(name_or_path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if (path / "config.json").is_file():
        return _config_from_dir(path)
    if name_or_path.strip().lower() in list_presets():
        return get_preset(name_or_path)  # a preset name: answered without importing torch
    looks_like_path = "/" in name_or_path or "\\" in name_or_path or name_or_path.startswith(
        ("~", ".")) or path.suffix in (".json", ".toml")
    if not path.exists():
        if looks_like_path:
            raise UserError(f"{name_or_path} does not exist; {_ACCEPTS}")
        return get_preset(name_or_path)  # unknown preset: the error lists close names
    if path.is_dir() and ((path / "checkpoints").is_dir() or (path / "config.toml").is_file()):
        kind = "run" if (path / "checkpoints").is_dir() else "checkpoint"
        raise UserError(
            f"{name_or_path} is a training {kind} directory, not a model directory; {_ACCEPTS}: "
            f"export it first (`densetrain export {name_or_path} --to-hf DIR`, then model-info "
            "DIR)"
        )
    kind = "directory without config.json" if path.is_dir() else "file, not a directory"
    raise UserError(f"{name_or_path} is a {kind}; {_ACCEPTS}")


def _config_from_dir(directory):
    """The ``ModelConfig`` of a densetrain or Hugging Face model directory, its ``config.json``
    checked (and, for a densetrain directory, its tensors' names, shapes and dtypes)."""
    from densetrain.models.hf.interop import read_hf_config
    from densetrain.models.hf.native import check_model_dir, is_model_dir

    return check_model_dir(directory) if is_model_dir(directory) else read_hf_config(directory)


def _model_info(args: argparse.Namespace) -> int:
    info = model_info(args.preset, seq_len=args.seq_len, kv_bytes=args.kv_bytes)
    serving_rows: list[tuple] = []
    if args.serve:
        from densetrain.cli.serving_args import serving_info

        info["serving"], serving_rows = serving_info(args, info["config"])
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cfg = info["config"]
    published = info["published_params"]
    rows = [
        ("model", f"{info['model']} (family {info['family']})"),
        ("shape", f"{cfg['num_layers']} layers, dim {cfg['dim']}, {cfg['num_heads']} heads "
                  f"({cfg['num_kv_heads']} kv) of {cfg['head_dim']}, ffn {cfg['ffn_dim']}, "
                  f"vocab {cfg['vocab_size']}"),
        ("parameters", f"{info['total_params']:,}"
                       + (f" (published {published / 1e9:g}B)" if published else "")),
        ("  non-embedding", f"{info['non_embedding_params']:,}"),
        ("  embedding", f"{info['embedding_params']:,}"),
        (f"FLOPs/token @ {info['seq_len']}", f"{info['flops_per_token_palm']:.4g} (PaLM 6N + "
         f"12LHQT), {info['flops_per_token_chinchilla']:.4g} (Chinchilla App. F)"),
        ("KV cache/token", f"{info['kv_cache_bytes_per_token']:,} bytes at "
                           f"{info['kv_cache_bytes_per_elem']} bytes per element"),
        *serving_rows,
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def preset_rows(family: str | None = None) -> list[dict]:
    """One row per preset (of ``family`` when given): name, family, shape and parameter counts,
    sorted by family then size. ``ValueError`` lists the families for an unknown one."""
    from densetrain.models import sizing
    from densetrain.models.presets import get_preset, list_presets

    names = list_presets()
    configs = {name: get_preset(name) for name in names}
    families = sorted({str(cfg.extra.get("family")) for cfg in configs.values()})
    if family is not None and family not in families:
        raise UserError(f"unknown family {family!r}; families: {families}")
    rows = []
    for name, cfg in configs.items():
        if family is not None and cfg.extra.get("family") != family:
            continue
        counts = sizing.param_counts(cfg)
        rows.append({
            "name": name, "family": cfg.extra.get("family"), "num_layers": cfg.num_layers,
            "dim": cfg.dim, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
            "total_params": counts.total, "non_embedding_params": counts.non_embedding,
            "published_params": cfg.extra.get("published_params"),
        })
    return sorted(rows, key=lambda r: (str(r["family"]), r["total_params"], r["name"]))


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def _presets(args: argparse.Namespace) -> int:
    rows = preset_rows(args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("preset", "family", "params", "non-emb", "layers", "dim", "heads", "kv", "vocab",
              "seq")
    table = [header] + [
        (r["name"], str(r["family"]), _human(r["total_params"]),
         _human(r["non_embedding_params"]), str(r["num_layers"]), str(r["dim"]),
         str(r["num_heads"]), str(r["num_kv_heads"]), str(r["vocab_size"]), str(r["max_seq_len"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `convert`, `model-info` and `presets` to subparsers."""
    convert = subparsers.add_parser(
        "convert",
        help="convert between Hugging Face checkpoints and densetrain model directories",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from densetrain.cli.export_cmd import add_export_options

    source = convert.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="Hugging Face checkpoint directory")
    source.add_argument("--to-hf", metavar="SOURCE",
                        help="run directory, training checkpoint or densetrain model directory "
                             "(the same as `densetrain export SOURCE --to-hf OUT`)")
    convert.add_argument("--out", required=True, help="directory to write (atomically)")
    add_export_options(convert)
    convert.set_defaults(func=_convert)

    info = subparsers.add_parser(
        "model-info",
        help="parameter counts, FLOPs per token and KV-cache bytes of a preset or model directory",
    )
    info.add_argument("preset", help="preset name (e.g. llama2-7b), a densetrain model directory "
                      "or a Hugging Face checkpoint directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--seq-len", type=int, default=None,
                      help="sequence length for FLOPs (default: the preset's max_seq_len)")
    info.add_argument("--kv-bytes", type=int, default=2,
                      help="bytes per KV-cache element (default 2: bf16)")
    from densetrain.cli.serving_args import add_serving_arguments

    add_serving_arguments(info)
    info.set_defaults(func=_model_info)

    presets = subparsers.add_parser(
        "presets", help="list the model presets with their sizes",
    )
    presets.add_argument("--family", default=None,
                         help="only this family (e.g. llama3, gpt2, qwen3)")
    presets.add_argument("--json", action="store_true", help="print JSON")
    presets.set_defaults(func=_presets)
