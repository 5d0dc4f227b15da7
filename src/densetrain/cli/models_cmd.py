"""Sub-commands `densetrain convert` and `densetrain model-info` (see cli/main.py).

``densetrain convert --from-hf DIR --out PATH`` reads a Hugging Face checkpoint directory
(``config.json`` + safetensors, sharded or not) and writes a densetrain model directory at PATH:
``config.json`` holding ``ModelConfig.to_dict()`` and ``model.safetensors`` holding the
``Transformer`` state dict under densetrain's parameter names (format:
``densetrain.models.hf.native``). ``densetrain convert --to-hf PATH --out DIR [--family F]``
goes back to a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
``densetrain model-info PRESET [--json]`` prints parameter counts, training FLOPs per token
(PaLM's 6N + 12·L·H·Q·T and Chinchilla's Appendix F count) and KV-cache bytes per token.
"""

from __future__ import annotations

import argparse
import json
import sys

_DTYPES = ("float32", "bfloat16", "float16")


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def _convert(args: argparse.Namespace) -> int:
    from densetrain.models.hf import load_hf, load_model, save_hf, save_model

    dtype = _torch_dtype(args.dtype)
    shard_bytes = int(args.max_shard_gb * 10**9)
    try:
        if args.from_hf:
            model = load_hf(args.from_hf, dtype=dtype)
            save_model(model, args.out, max_shard_bytes=shard_bytes, overwrite=args.overwrite)
            source = args.from_hf
        else:
            model = load_model(args.to_hf, dtype=dtype)
            save_hf(
                model,
                args.out,
                hf_family=args.family,
                max_shard_bytes=shard_bytes,
                overwrite=args.overwrite,
            )
            source = args.to_hf
    except (ValueError, FileExistsError) as error:
        print(f"densetrain convert: error: {error}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    print(f"converted {source} -> {args.out} ({params:,} parameters)")
    return 0


def model_info(name_or_path: str, *, seq_len: int | None = None, kv_bytes: int = 2) -> dict:
    """Sizes of a preset (or of the ``config.json`` in a model directory) as a plain dict."""
    from densetrain.models import sizing
    from densetrain.models.presets import get_preset

    cfg = _config_from_path(name_or_path)
    if cfg is None:
        cfg = get_preset(name_or_path)
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


def _config_from_path(path_str: str):
    """The ``ModelConfig`` of a densetrain or Hugging Face model directory, else None."""
    from pathlib import Path

    from densetrain.models import ModelConfig
    from densetrain.models.hf import config_from_hf

    config_path = Path(path_str) / "config.json"
    if not config_path.is_file():
        return None
    data = json.loads(config_path.read_text())
    return config_from_hf(data) if "model_type" in data else ModelConfig.from_dict(data)


def _model_info(args: argparse.Namespace) -> int:
    try:
        info = model_info(args.preset, seq_len=args.seq_len, kv_bytes=args.kv_bytes)
    except ValueError as error:
        print(f"densetrain model-info: error: {error}", file=sys.stderr)
        return 2
    serving_rows: list[tuple] = []
    if args.serve:
        from densetrain.cli.serving_args import serving_info

        try:
            info["serving"], serving_rows = serving_info(args, info["config"])
        except ValueError as error:
            print(f"densetrain model-info: error: {error}", file=sys.stderr)
            return 2
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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `convert` and `model-info` to subparsers."""
    convert = subparsers.add_parser(
        "convert",
        help="convert between Hugging Face checkpoints and densetrain model directories",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = convert.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="Hugging Face checkpoint directory")
    source.add_argument("--to-hf", metavar="PATH", help="densetrain model directory")
    convert.add_argument("--out", required=True, help="directory to write (atomically)")
    convert.add_argument(
        "--family", default=None,
        help="Hugging Face model_type to export as (default: the config's extra.hf_family)",
    )
    convert.add_argument("--dtype", choices=_DTYPES, default=None,
                         help="cast weights (default: keep)")
    convert.add_argument("--max-shard-gb", type=float, default=5.0,
                         help="shard the safetensors past this size (default 5)")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    convert.set_defaults(func=_convert)

    info = subparsers.add_parser(
        "model-info",
        help="parameter counts, FLOPs per token and KV-cache bytes of a preset",
    )
    info.add_argument("preset", help="preset name (e.g. llama2-7b) or a model directory")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--seq-len", type=int, default=None,
                      help="sequence length for FLOPs (default: the preset's max_seq_len)")
    info.add_argument("--kv-bytes", type=int, default=2,
                      help="bytes per KV-cache element (default 2: bf16)")
    from densetrain.cli.serving_args import add_serving_arguments

    add_serving_arguments(info)
    info.set_defaults(func=_model_info)
