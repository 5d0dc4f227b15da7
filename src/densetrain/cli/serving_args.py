"""`densetrain model-info NAME --serve --cluster C`: the serving-cost options and report
(the numbers come from ``densetrain.planner.serving``)."""

from __future__ import annotations

import argparse


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--serve`` and its options to the ``model-info`` parser."""
    group = parser.add_argument_group("serving cost (--serve)")
    group.add_argument("--serve", action="store_true",
                       help="also print prefill/decode FLOPs, KV-cache bytes, the decode "
                       "tokens/s bound and the largest batch on --cluster")
    group.add_argument("--cluster", default="h100-80gb",
                       help="accelerator of the planner's hardware table (default h100-80gb)")
    group.add_argument("--cluster-file", default=None, help="TOML/JSON file of custom clusters")
    group.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    group.add_argument("--context", type=int, default=None,
                       help="tokens per sequence (default: --seq-len or max_seq_len)")
    group.add_argument("--serve-devices", type=int, default=1,
                       help="devices sharing the model (tensor parallel; default 1)")
    group.add_argument("--weight-bytes", type=float, default=2.0,
                       help="bytes per weight (default 2: bf16)")
    group.add_argument("--memory-fraction", type=float, default=0.9,
                       help="share of device memory for weights and cache (default 0.9)")


def serving_info(args: argparse.Namespace, config: dict) -> tuple[dict, list[tuple]]:
    """(JSON-able costs, printable rows) for the model whose ``to_dict()`` is ``config``."""
    from densetrain.models.config import ModelConfig
    from densetrain.planner.hardware import get_cluster, load_cluster_file
    from densetrain.planner.serving import ServingSetup, format_serving, serving_cost

    cfg = ModelConfig.from_dict(config)
    extra = load_cluster_file(args.cluster_file) if args.cluster_file else {}
    cluster = get_cluster(args.cluster, extra)
    setup = ServingSetup(context_len=args.context or args.seq_len or cfg.max_seq_len,
                         batch_size=args.batch, kv_bytes_per_elem=args.kv_bytes,
                         weight_bytes_per_param=args.weight_bytes, devices=args.serve_devices,
                         memory_fraction=args.memory_fraction)
    cost = serving_cost(cfg, cluster, setup)
    data = {"cluster": cluster.name, "devices": setup.devices, "batch_size": setup.batch_size,
            "context_len": setup.context_len, **cost.as_dict()}
    return data, format_serving(cost, cluster, setup)
