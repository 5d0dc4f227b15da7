"""The dry-run report: per simulated rank, what it holds at its peak and what it moves."""

from __future__ import annotations

from densetrain.dryrun.run import RankReport

KINDS_SHOWN = 8
"""How many kinds of live bytes at the peak a report lists (the largest)."""
GIB = 2**30


def default_ranks(world_size: int, pp: int) -> list[int]:
    """One rank per distinct role: the first and last rank, and with pipeline parallel the
    first rank of the first, the second (with the first stage's layer fewer, it holds the most
    activations: one microbatch fewer in flight, one layer more), a middle and the last stage
    (pp is the mesh's outer axis)."""
    per_stage = world_size // pp
    ranks = {0, world_size - 1}
    if pp > 2:
        ranks.update((per_stage, (pp // 2) * per_stage))
    return sorted(ranks)


def format_report(reports: list[RankReport],
                  predicted: dict[int, dict[str, float]] | None = None,
                  device_bytes: float | None = None,
                  comm: dict[int, dict[str, tuple]] | None = None) -> str:
    """Lines of the report (GiB; collectives in GB); ``predicted``: the planner's memory per
    device for each report's rank (`dryrun.predict.planner_by_rank`), printed beside the
    traced figures; ``comm``: traced and predicted bytes sent per step by kind
    (`dryrun.predict.comm_by_rank`)."""
    lines = []
    for r in reports:
        prediction = (predicted or {}).get(r.rank)
        where = ", ".join(f"{k} {v}" for k, v in r.coordinates.items()) or "single process"
        traced = ("one micro-batch" if r.traced_microbatches == 1
                  else f"{r.traced_microbatches} micro-batches")
        lines.append(f"rank {r.rank} of {r.world_size} ({where}): {r.local_params:,} parameters;"
                     f" {traced} of {r.micro_batch_size} x {r.seq_len} tokens traced"
                     f" ({r.microbatches} per step) in {r.seconds:.1f} s")
        lines.append(f"  parameters {r.param_bytes / GIB:8.3f} GiB   gradients "
                     f"{r.grad_bytes / GIB:8.3f} GiB   optimizer "
                     f"{r.optimizer_bytes / GIB:8.3f} GiB")
        phases = "   ".join(f"{name} {size / GIB:.3f}" for name, size in r.phase_peaks.items()
                           if name != "start")
        fits = ""
        if device_bytes:
            fits = (f"   ({100 * r.peak_bytes / device_bytes:.0f}% of the device's "
                    f"{device_bytes / GIB:.0f} GiB)")
        lines.append(f"  peak      {r.peak_bytes / GIB:8.3f} GiB{fits}   by phase: {phases}")
        if prediction:
            lines.append(
                f"  planner   parameters {prediction['params'] / GIB:.3f}   gradients "
                f"{prediction['grads'] / GIB:.3f}   optimizer {prediction['optimizer'] / GIB:.3f}"
                f"   activations {prediction['activations'] / GIB:.3f}   buffers "
                f"{prediction['buffers'] / GIB:.3f}   optimizer step "
                f"{prediction.get('optimizer_step', 0.0) / GIB:.3f}   peak "
                f"{prediction['total'] / GIB:.3f} GiB "
                f"(traced/predicted peak {r.peak_bytes / prediction['total']:.2f})")
        top = sorted(r.kinds_at_peak.items(), key=lambda kv: -kv[1])[:KINDS_SHOWN]
        if top:
            lines.append("  at the peak: " + "; ".join(f"{kind} {size / GIB:.2f}"
                                                     for kind, size in top) + " GiB")
        if r.save_items:
            lines.append(f"  save plan {r.save_items:,} items, {r.save_bytes / GIB:.3f} GiB of "
                         "tensors from this rank (DCP's local plan)")
        for c in r.collectives:
            dtypes = ", ".join(f"{n} {d}" for d, n in sorted(c.dtypes.items()))
            lines.append(f"  {c.kind:<15} over {c.group:<12} {c.calls:5d} calls "
                         f"{c.bytes / 1e9:10.3f} GB   ({dtypes})")
        for kind, (traced, planned) in (comm or {}).get(r.rank, {}).items():
            if traced is None:  # `dryrun.predict.pipelined_fsdp_calls`
                lines.append(f"  sent per step over {kind:<3} not compared: the traced "
                             "microbatches' FSDP calls do not extrapolate to the step under "
                             "this pipeline schedule")
                continue
            versus = (f"planner {planned / 1e9:.1f} GB (traced/predicted "
                      f"{traced / planned:.3f})" if planned else "planner 0")
            lines.append(f"  sent per step over {kind:<3} traced {traced / 1e9:10.1f} GB   "
                         f"{versus}")
        if r.notes:
            lines.append("  notes: " + "; ".join(r.notes))
        lines.append("  not traced: " + "; ".join(r.not_traced))
    return "\n".join(lines)
