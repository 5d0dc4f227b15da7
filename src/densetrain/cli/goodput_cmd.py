"""`densetrain goodput RUN_DIR`: where a run's wall time went (table + PNG timeline).

Reads ``RUN_DIR/goodput.jsonl`` (written by every process of the run as it goes) and prints the
seconds and share of wall time of each bucket: productive steps, steps recomputed after a
rollback or restart, start-up, data waits, fault checks, evaluation, callbacks (logging and
checkpoint saves) and down time between processes. Writes ``RUN_DIR/goodput.png``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``goodput`` sub-command."""
    parser = subparsers.add_parser("goodput", help="account a run's wall time (table + PNG)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run's directory (logging.run_dir)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    parser.set_defaults(func=run_goodput)


def run_goodput(args: argparse.Namespace) -> int:
    """Print the table and write the timeline."""
    from densetrain.errors import UserError
    from densetrain.train.goodput import LEDGER_FILE, ledger_totals, ledger_waiting, read_ledger

    lines = read_ledger(args.run_dir)
    if not lines:
        raise UserError(f"{Path(args.run_dir) / LEDGER_FILE} holds no entries: no process of "
                        "the run has finished an iteration yet, so there is no time to account")
    totals, wall = ledger_totals(lines)
    processes = len({e["process"] for e in lines})
    print(f"{args.run_dir}: {wall:.1f} s of wall time over {processes} process(es)")
    print(f"{'bucket':<12} {'seconds':>10} {'share':>8}")
    for bucket, seconds in totals.items():
        print(f"{bucket:<12} {seconds:>10.1f} {100 * seconds / wall if wall else 0:>7.1f}%")
    accounted = sum(totals.values())
    print(f"{'accounted':<12} {accounted:>10.1f} {100 * accounted / wall if wall else 0:>7.1f}%")
    print(f"goodput (productive / wall): {totals['productive'] / wall if wall else 0:.3f}")
    waited, stragglers = ledger_waiting(lines)
    if any("collective_wait_s" in e for e in lines):
        print(f"waiting in collectives for slower ranks (mean over ranks, inside the step "
              f"buckets): {waited:.1f} s ({100 * waited / wall if wall else 0:.1f}% of wall)")
    for s in stragglers:
        print(f"straggler: rank {s['rank']} (host {s.get('host', '?')}) up to "
              f"{float(s['factor']):.2f}x the median rank, steps {s['since_step']}-"
              f"{s['last_step']}")
    if not args.no_plot:
        print(f"timeline: {plot_timeline(lines, Path(args.run_dir))}")
    return 0


def plot_timeline(lines: list[dict], run_dir: Path) -> Path:
    """``run_dir/goodput.png``: each ledger line's buckets as consecutive bars (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from densetrain.train.goodput import BUCKETS

    colours = dict(zip(BUCKETS, plt.get_cmap("tab10").colors, strict=False))
    origin = min(float(e["start"]) for e in lines)
    fig, ax = plt.subplots(figsize=(9, 2.5), dpi=100)
    for entry in lines:
        at = float(entry["start"]) - origin
        for bucket, seconds in entry["buckets"].items():
            ax.broken_barh([(at, float(seconds))], (0, 1), color=colours.get(bucket, "grey"))
            at += float(seconds)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), ncol=4, fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.35))
    ax.set_yticks([])
    ax.set_xlabel("seconds since the run's first process started")
    ax.set_title(f"{run_dir.name}: goodput timeline (gaps: down)")
    path = run_dir / "goodput.png"
    tmp = path.with_name("goodput.tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path
