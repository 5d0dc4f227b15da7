"""`densetrain plan`: layout search for a model on a cluster, or a compute-optimal run plan.

    densetrain plan --model llama3-70b --seq-len 8192 --global-batch 1024 --cluster h100 \
        --devices 1024
    densetrain plan --flops 1e24 --cluster h200 --devices 2048
    densetrain plan --list-clusters [--cluster-file my_clusters.toml]
"""

from __future__ import annotations

import argparse
import sys

from densetrain.cli.argtypes import count, number
from densetrain.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command to ``subparsers``."""
    p = subparsers.add_parser(
        "plan",
        help="rank parallel layouts by predicted throughput (or plan a compute-optimal run)",
        description="Predict memory, FLOPs, communication and step time of every layout that "
        "fits, rank them by tokens/s and explain the winner. With --flops, first choose the "
        "compute-optimal model size and token count.",
    )
    p.add_argument("--model", default=None,
                   help="preset name (e.g. llama3-8b) or a TOML/JSON file of ModelConfig fields "
                   "(top level or a [model] table); with --flops, the base whose non-size "
                   "fields are kept (default llama3-8b)")
    p.add_argument("--flops", type=number(above=0), default=None,
                   help="training budget in FLOPs: plan a compute-optimal run")
    p.add_argument("--inference-tokens", type=number(at_least=0), default=0.0,
                   help="with --flops: expected lifetime inference tokens; --flops is then the "
                   "training + inference budget and the plan is the over-trained run "
                   "(Sardana et al. 2024)")
    p.add_argument("--seq-len", type=count(1), default=4096,
                   help="tokens per sequence (default 4096)")
    p.add_argument("--global-batch", type=count(1), default=1024, help="sequences per step")
    p.add_argument("--cluster", default="h100-80gb", help="built-in or custom cluster name")
    p.add_argument("--cluster-file", default=None, help="TOML/JSON file of custom clusters")
    p.add_argument("--devices", type=count(1), default=None, help="number of accelerators")
    p.add_argument("--precision", default="bf16-mixed",
                   help="bf16-mixed (ZeRO paper's 2+2+12 bytes), fsdp2-bf16, fp32")
    p.add_argument("--efficiency", type=number(above=0, at_most=1), default=None,
                   help="share of peak FLOP/s a large GEMM reaches (default: the cluster's "
                   "measured figure)")
    p.add_argument("--no-flash", action="store_true",
                   help="attention stores the s x s scores (no FlashAttention)")
    p.add_argument("--max-tp", type=count(1, "1 = no tensor-parallel split"), default=64,
                   help="largest tensor-parallel degree searched (default 64)")
    p.add_argument("--max-cp", type=count(1, "1 = no context-parallel split"), default=16,
                   help="largest context-parallel degree searched (default 16)")
    p.add_argument("--top", type=count(1), default=10, help="rows of the ranked table")
    p.add_argument("--list-clusters", action="store_true", help="print the cluster table")
    p.add_argument("--calibrate", default=None, metavar="OUT.toml",
                   help="measure this machine (GEMM sweep, memory bandwidth, gloo all-reduce "
                   "between local ranks) and write it as cluster 'this-machine'")
    p.add_argument("--calibrate-ranks", type=count(2, "collectives need two processes"),
                   default=None,
                   help="local processes for the collective measurement (default 2)")
    p.add_argument("--emit-config", default=None, metavar="OUT.toml",
                   help="write the winner as a job config that `densetrain train OUT.toml` runs")
    p.add_argument("--verify", action="store_true",
                   help="dry-run the winner's job (as --emit-config writes it) on fake tensors "
                   "and print each simulated rank's traced memory beside the prediction")
    p.set_defaults(func=run_plan_command)


def _load_model(spec: str):
    from pathlib import Path

    from densetrain.models.config import ModelConfig

    path = Path(spec)
    if path.suffix in (".toml", ".json") or path.exists():
        if not path.exists():
            raise UserError(f"--model: file {spec} does not exist")
        import json

        from densetrain.coerce import coerce_dataclass, tomllib

        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, UnicodeDecodeError) as error:  # JSON and TOML decode errors
            kind = "JSON" if path.suffix == ".json" else "TOML"
            raise UserError(f"--model: {spec} is not valid {kind}: {error}") from None
        data = data.get("model", data) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise UserError(f"--model: {spec} must hold a table of ModelConfig fields (at the "
                            f"top level or under [model]), got a {type(data).__name__}")
        try:  # each field checked against its type, unknown keys with close matches
            return coerce_dataclass(data, ModelConfig, "model")
        except ValueError as error:
            raise UserError(f"--model: {spec}: {error}") from None
    from densetrain.models.presets import get_preset

    return get_preset(spec)


def _calibrate(args: argparse.Namespace) -> int:
    from densetrain.planner.calibrate import calibrate

    try:
        given = {} if args.calibrate_ranks is None else {"ranks": args.calibrate_ranks}
        path, entry = calibrate(args.calibrate, **given)  # calibrate() holds the default
    except RuntimeError as e:
        print(f"densetrain plan: calibration failed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}: " + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()
                                        if not isinstance(v, str)))
    print(f"use it with: densetrain plan --cluster-file {path} --cluster this-machine ...")
    return 0


def _emit(args: argparse.Namespace, result) -> None:
    from pathlib import Path

    from densetrain.planner.emit import emit_config

    is_file = Path(args.model).suffix in (".toml", ".json") or Path(args.model).exists()
    path = emit_config(args.emit_config, result.cfg, result.layout(0), seq_len=result.seq_len,
                       global_batch=result.global_batch, preset=None if is_file else args.model,
                       precision=args.precision)
    print(f"\nwrote {path}: densetrain train {path} runs the winner on {result.devices} "
          "processes (torchrun --nproc-per-node ...)")


def _verify(args: argparse.Namespace, result) -> None:
    """Dry-run the winner's job and print predicted against traced, per simulated rank."""
    from pathlib import Path

    from densetrain.dryrun.predict import comm_by_rank, planner_by_rank
    from densetrain.dryrun.report import default_ranks, format_report
    from densetrain.dryrun.run import dry_run_ranks
    from densetrain.planner.emit import plan_job

    is_file = Path(args.model).suffix in (".toml", ".json") or Path(args.model).exists()
    layout = result.layout(0)
    job = plan_job(result.cfg, layout, seq_len=result.seq_len, global_batch=result.global_batch,
                   preset=None if is_file else args.model, precision=args.precision)
    row = result.row(0)
    print(f"\nverify: the winner's job dry-run on {layout.devices} simulated ranks. The plan "
          f"counted {row['mem_total'] / 2**30:.2f} GiB per device at precision {args.precision}; "
          "each 'planner' line below counts again with the bytes the trainer holds (fp32 "
          "parameters, gradients and gathers) beside what the dry run traced")
    reports = dry_run_ranks(job, layout.devices, default_ranks(layout.devices, layout.pp))
    print(format_report(reports, planner_by_rank(job, layout.devices, reports),
                        comm=comm_by_rank(job, layout.devices, reports)))


def _print_clusters(extra) -> None:
    from densetrain.planner.hardware import BUILTIN_CLUSTERS

    table = {**BUILTIN_CLUSTERS, **extra}
    print(f"{'name':<14} {'TFLOP/s':>8} {'mem GB':>7} {'HBM TB/s':>8} {'per node':>8} "
          f"{'intra GB/s':>10} {'inter GB/s':>10}")
    for c in table.values():
        print(f"{c.name:<14} {c.peak_flops / 1e12:>8.0f} {c.memory_bytes / 1e9:>7.1f} "
              f"{c.hbm_bytes_per_s / 1e12:>8.2f} {c.devices_per_node:>8} "
              f"{c.intra_node_bytes_per_s / 1e9:>10.0f} {c.inter_node_bytes_per_s / 1e9:>10.1f}")


def run_plan_command(args: argparse.Namespace) -> int:
    """Run the search (or the compute-optimal chain) and print the report."""
    from densetrain.planner.hardware import get_cluster, load_cluster_file
    from densetrain.planner.layout import PlanSettings
    from densetrain.planner.report import full_report
    from densetrain.planner.run_plan import format_run_plan, plan_run
    from densetrain.planner.search import NoFeasibleLayoutError, SearchSpace, search

    try:
        extra = load_cluster_file(args.cluster_file) if args.cluster_file else {}
        if args.list_clusters:
            _print_clusters(extra)
            return 0
        if args.calibrate:
            return _calibrate(args)
        if args.calibrate_ranks is not None and not args.calibrate:
            raise UserError("--calibrate-ranks needs --calibrate OUT.toml (it sets how many "
                            "ranks the calibration measures)")
        if args.devices is None:
            raise UserError("--devices is required (number of accelerators)")
        cluster = get_cluster(args.cluster, extra)
        settings = PlanSettings(precision=args.precision, compute_efficiency=args.efficiency,
                                flash_attention=not args.no_flash)
        space = SearchSpace(max_tp=args.max_tp, max_cp=args.max_cp)
        common = dict(seq_len=args.seq_len, global_batch=args.global_batch,
                      devices=args.devices, cluster=cluster, settings=settings, space=space)
        if args.flops is not None:
            base = _load_model(args.model or "llama3-8b")
            from densetrain.scaling.optimal import allocation

            plan = plan_run(allocation(args.flops, inference_tokens=args.inference_tokens),
                            base=base, **common)
            print(format_run_plan(plan))
            print()
            print(full_report(plan.layout_plan, top=args.top))
            return 0
        if args.inference_tokens:
            raise UserError("--inference-tokens needs --flops (a lifetime FLOP budget)")
        if args.model is None:
            raise UserError("--model is required without --flops (a preset name or a file)")
        result = search(_load_model(args.model), **common)
        print(full_report(result, top=args.top))
        if args.emit_config:
            _emit(args, result)
        if args.verify:
            _verify(args, result)
        return 0
    except NoFeasibleLayoutError as e:  # an answer, not an input error: exit 1 with the why
        print(f"densetrain plan: no feasible layout: {e}", file=sys.stderr)
        return 1
