"""Human-readable answers: the ranked table, the winner's breakdown, and why the close ones lose."""

from __future__ import annotations

from math import inf

from densetrain.planner.search import PlanResult, traffic_bytes

GB = 1e9
TIME_PARTS = (
    ("compute_s", "compute"),
    ("bubble_s", "pipeline bubble"),
    ("tp_exposed_s", "tensor-parallel communication"),
    ("pp_exposed_s", "pipeline transfers"),
    ("cp_exposed_s", "exposed context-parallel communication"),
    ("dp_exposed_s", "exposed data-parallel communication"),
    ("optimizer_s", "optimizer step"),
    ("host_s", "host dispatch"),
)


def format_table(result: PlanResult, top: int = 10) -> str:
    """The ``top`` ranked layouts: tokens/s, MFU, step time and memory per device."""
    header = (f"{'#':>3}  {'layout':<52} {'tok/s':>11} {'MFU':>6} {'step s':>8} "
              f"{'mem GB':>7} {'µbatch':>6}")
    lines = [header, "-" * len(header)]
    for i in range(min(top, len(result))):
        row = result.row(i)
        lines.append(
            f"{i + 1:>3}  {result.layout(i).describe():<52} {row['tokens_per_s']:>11,.0f} "
            f"{row['mfu']:>6.1%} {row['step_s']:>8.3f} {row['mem_total'] / GB:>7.1f} "
            f"{int(row['mem_microbatches']):>6}"
        )
    return "\n".join(lines)


def explain_winner(result: PlanResult) -> str:
    """Where the winner's step time and memory go."""
    row, layout = result.row(0), result.layout(0)
    usable = result.cluster.memory_bytes * result.settings.usable_memory_fraction
    parts = ", ".join(f"{label} {row[key]:.3f}" for key, label in TIME_PARTS if row[key] > 0)
    mem = ", ".join(f"{name} {row['mem_' + name] / GB:.1f}" for name in
                    ("params", "grads", "optimizer", "activations", "head", "buffers"))
    comm = ", ".join(f"{kind.upper()} {row[kind + '_bytes'] / GB:.2f}"
                     for kind in ("tp", "dp", "pp", "cp") if row[kind + "_bytes"] > 0)
    return "\n".join([
        f"Winner: {layout.describe()}",
        f"  step {row['step_s']:.3f} s = {parts}",
        f"  {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%} "
        f"(model {row['model_flops_per_step']:.3e} FLOP/step, hardware "
        f"{row['hardware_flops_per_step']:.3e})",
        f"  memory per device {row['mem_total'] / GB:.1f} of {usable / GB:.1f} GB usable: {mem}",
        f"  communication per device per step (GB): {comm or 'none'}",
        f"  {int(row['mem_microbatches'])} microbatches of {layout.micro_batch_size} per "
        "data-parallel rank",
        "  [parallel] " + ", ".join(f"{k} = {_toml(v)}"
                                    for k, v in layout.to_parallel_config().items()),
    ])


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


TIE = 1e-3
"""Runners-up less than this share slower than the winner tie with it: the step-time model does
not separate them."""


def explain_runners_up(result: PlanResult, count: int = 4) -> str:
    """The layouts that tie with the winner, in one line, then for the next ``count`` distinct
    layouts: how much slower and which step-time part costs them most."""
    best = result.row(0)
    lines = ["Close ones:"]
    ties: list[tuple[str, dict]] = []  # (layout, row) of the layouts tied with the winner
    seen = {_signature(result, 0)}
    for i in range(1, len(result)):
        if len(lines) > count:
            break
        sig = _signature(result, i)
        if sig in seen:
            continue
        seen.add(sig)
        row = result.row(i)
        slower = 1 - row["tokens_per_s"] / best["tokens_per_s"]
        if slower < TIE:
            ties.append((result.layout(i).describe(), row))
            continue
        deltas = sorted(((row[k] - best[k], label) for k, label in TIME_PARTS), reverse=True)
        worse, label = deltas[0]
        why = f"+{worse:.3f} s of {label}" if worse > 0 else "no part slower"
        gains = [f"{-d:.3f} s less {lab}" for d, lab in deltas if d < 0][:1]
        extra = f" (despite {gains[0]})" if gains else ""
        mem_note = ""
        if row["mem_total"] < best["mem_total"]:
            mem_note = f"; uses {(best['mem_total'] - row['mem_total']) / GB:.1f} GB less memory"
        lines.append(f"  {result.layout(i).describe()}: {slower:.2%} slower, mainly {why}"
                     f"{extra}{mem_note}")
    out = []
    if ties:
        names = [name for name, _ in ties]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        least = traffic_bytes(best)
        as_few = [row["mem_total"] for _, row in ties if traffic_bytes(row) == least]
        if (least <= min(traffic_bytes(row) for _, row in ties)
                and best["mem_total"] <= min(as_few, default=inf)):
            why = "the winner moves the fewest bytes of them" + (
                ", and needs the least memory of those that move as few" if as_few else "")
        else:
            why = f"the winner leads them by less than {TIE:.1%}"
        out.append(f"Tied with the winner ({len(ties)} layout{'s' if len(ties) > 1 else ''} "
                   f"within {TIE:.1%} of its step time, which the model does not separate; "
                   f"{why}): {shown}")
    if len(lines) > 1:
        out.append("\n".join(lines))
    else:
        out.append("No slower layout fits." if ties else "No other layout fits.")
    return "\n\n".join(out)


def _signature(result: PlanResult, i: int) -> tuple:
    """Layouts that differ only in how data parallelism splits into replicate x shard share a
    signature, so the runners-up show different choices rather than HSDP variants."""
    lay = result.layout(i)
    return (lay.tp, lay.sequence_parallel, lay.pp, lay.pp_schedule, lay.pp_virtual_stages,
            lay.cp, lay.zero_stage, lay.activation_checkpointing, lay.micro_batch_size)


def full_report(result: PlanResult, top: int = 10) -> str:
    """Header, table, winner and runners-up as one printable block."""
    cfg = result.cfg
    head = (f"Plan for {result.devices} x {result.cluster.name}: seq {result.seq_len}, global "
            f"batch {result.global_batch} sequences ({result.global_batch * result.seq_len:,} "
            f"tokens); model dim {cfg.dim}, {cfg.num_layers} layers, {cfg.num_heads} heads. "
            f"{len(result):,} of {result.num_candidates:,} layouts fit; searched in "
            f"{result.elapsed_s:.2f} s.")
    return "\n\n".join([head, format_table(result, top), explain_winner(result),
                        explain_runners_up(result)])
