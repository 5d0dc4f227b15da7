"""Run an IsoFLOP design and collect its runs into a results CSV.

Layout of a sweep directory::

    design.csv            the planned points (written before any run)
    runs/<name>/          one ``densetrain train`` run directory per point (metrics.jsonl,
                          summary.json, train.log)
    slurm/<name>.sbatch   batch scripts when launched through SLURM
    results.csv           one row per finished run (``collect_results``)
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from densetrain.errors import UserError
from densetrain.scaling.results import atomic_write_text, write_results_csv
from densetrain.scaling.sweep import (
    LAUNCHERS,
    SweepConfig,
    SweepPoint,
    launch_command,
    slurm_script,
)

DESIGN_COLUMNS = ("name", "budget", "target_params", "params", "param_count", "tokens", "flops",
                  "steps", "warmup_steps", "dim", "num_layers", "num_heads", "ffn_dim", "run_dir")
RESULT_COLUMNS = ("name", "budget", "params", "tokens", "flops", "loss", "final_loss",
                  "final_val_loss", "total_params", "non_embedding_params", "flops_actual",
                  "steps", "dim", "num_layers", "wall_s", "run_dir")


def write_design(out_dir: Path, points: list[SweepPoint], cfg: SweepConfig) -> Path:
    """Write ``design.csv`` listing every planned run.

    Rows already in an existing ``design.csv`` of the directory are kept (a sweep directory
    accumulates points: re-running with a wider ``n_span`` or more budgets adds runs), so
    ``collect_results`` sees every run planned there. Rows are sorted by budget, then N.
    """
    path = out_dir / "design.csv"
    rows: dict[str, dict] = {}
    if path.is_file():
        with path.open(newline="") as handle:
            rows = {row["name"]: row for row in csv.DictReader(handle)}
    for p in points:
        rows[p.name] = {
            "name": p.name, "budget": p.budget, "target_params": round(p.target_params),
            "params": p.params, "param_count": cfg.param_count, "tokens": p.tokens,
            "flops": p.flops, "steps": p.steps, "warmup_steps": p.warmup_steps,
            "dim": p.shape.dim, "num_layers": p.shape.num_layers,
            "num_heads": p.shape.num_heads, "ffn_dim": p.shape.ffn_dim,
            "run_dir": f"runs/{p.name}",
        }
    ordered = sorted(rows.values(), key=lambda r: (float(r["budget"]), int(r["params"])))
    write_results_csv(path, ordered, DESIGN_COLUMNS)
    return path


def run_sweep(
    points: list[SweepPoint],
    cfg: SweepConfig,
    out_dir: str | Path,
    *,
    launcher: str = "local",
    dry_run: bool = False,
    keep_going: bool = False,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    jobs: int = 1,
    threads: int | None = None,
    loss_field: str = "final_val_loss",
    echo: Callable[[str], None] = print,
) -> Path | None:
    """Run (or print, with ``dry_run``) every point; returns ``results.csv`` once collected.

    "local" and "torchrun" run the points here, ``jobs`` at a time, and collect at the end;
    ``threads`` sets ``OMP_NUM_THREADS`` of each run (on a busy shared CPU one thread per run
    was several times faster than two). "slurm" writes one batch script per point and submits
    it with ``sbatch`` (collect later with ``collect_results``). A failed run raises
    ``RuntimeError`` naming its log, unless ``keep_going``.
    """
    if launcher not in LAUNCHERS:
        raise UserError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if jobs < 1:
        raise UserError(f"jobs must be >= 1, got {jobs}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_design(out_dir, points, cfg)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    pending: list[tuple[str, list[str], Path]] = []
    for index, point in enumerate(points, start=1):
        run_dir = out_dir / "runs" / point.name
        if (run_dir / "summary.json").is_file():
            echo(f"[{index}/{len(points)}] {point.name}: done already, skipped")
            continue
        if launcher == "slurm":
            script = out_dir / "slurm" / f"{point.name}.sbatch"
            atomic_write_text(script, slurm_script(point, cfg, str(run_dir),
                                                   nproc_per_node=nproc_per_node, nnodes=nnodes))
            command = ["sbatch", str(script)]
        else:
            command = launch_command(point, cfg, str(run_dir), launcher=launcher,
                                     nproc_per_node=nproc_per_node)
        if dry_run:
            echo(shlex.join(command))
            continue
        label = (f"[{index}/{len(points)}] {point.name}: N={point.params:,} D={point.tokens:,} "
                 f"steps={point.steps}")
        pending.append((label, command, run_dir, _estimated_cost(point, cfg)))
    # longest runs first, so that parallel jobs finish together
    pending = [item[:3] for item in sorted(pending, key=lambda item: -item[3])]
    failed = _run_all(pending, launcher, env, jobs=jobs, keep_going=keep_going, echo=echo)
    if dry_run or launcher == "slurm":
        return None
    if failed:
        echo(f"failed runs (left out of results): {failed}")
    return collect_results(out_dir, loss_field=loss_field)


def _estimated_cost(point: SweepPoint, cfg: SweepConfig) -> float:
    """FLOPs including the output layer and attention (PaLM's 6N + 12·L·d·T per token)."""
    per_token = (6 * point.params + 6 * cfg.vocab_size * point.shape.dim
                 + 12 * point.shape.num_layers * point.shape.dim * cfg.seq_len)
    return float(per_token * point.tokens)


def _run_all(pending, launcher: str, env, *, jobs: int, keep_going: bool, echo) -> list[str]:
    failed: list[str] = []

    def one(item: tuple[str, list[str], Path]) -> None:
        label, command, run_dir = item
        echo(f"{label} started")
        ok, wall = _run_one(command, run_dir, launcher, env)
        echo(f"{label} {'finished' if ok else 'FAILED'} in {wall:.0f} s")
        if not ok:
            failed.append(run_dir.name)
            if not keep_going:
                raise RuntimeError(f"run {run_dir.name} failed; see {run_dir / 'train.log'}")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(one, item) for item in pending]:
            future.result()
    return failed


def _run_one(command: list[str], run_dir: Path, launcher: str, env) -> tuple[bool, float]:
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, env=env)
    wall = time.perf_counter() - start
    if launcher != "slurm":
        atomic_write_text(run_dir / "sweep_wall.json", json.dumps({"wall_s": wall}))
    return proc.returncode == 0 and (run_dir / "summary.json").is_file(), wall


def collect_results(out_dir: str | Path, *, loss_field: str = "final_val_loss") -> Path:
    """Read ``design.csv`` and each finished run's ``summary.json`` into ``results.csv``.

    ``params`` is N as the design counted it (``non_embedding_params`` or the total), ``tokens``
    the tokens trained on, ``flops`` = 6·N·D and ``loss`` the summary field ``loss_field``;
    ``run_dir`` is relative to the sweep directory (where ``results.csv`` is written).
    Unfinished runs are left out; none finished raises ``ValueError``.
    """
    out_dir = Path(out_dir)
    design_path = out_dir / "design.csv"
    if not design_path.is_file():
        raise UserError(f"{design_path} does not exist: not a sweep directory")
    with design_path.open(newline="") as handle:
        design = list(csv.DictReader(handle))
    rows = []
    for planned in design:
        summary_path = out_dir / planned["run_dir"] / "summary.json"
        if summary_path.is_file():
            rows.append(_result_row(planned, json.loads(summary_path.read_text()), loss_field,
                                    summary_path))
    if not rows:
        raise UserError(f"{out_dir}: no finished runs (no runs/*/summary.json)")
    path = out_dir / "results.csv"
    write_results_csv(path, rows, RESULT_COLUMNS)
    return path


def _result_row(planned: dict, summary: dict, loss_field: str, source: Path) -> dict:
    for key in (loss_field, "tokens", "params", "non_embedding_params"):
        if summary.get(key) is None:
            raise UserError(f"{source}: field {key!r} is missing (needed for the results)")
    count_key = "non_embedding_params" if planned["param_count"] == "non_embedding" else "params"
    params = int(summary[count_key])
    tokens = int(summary["tokens"])
    wall_path = source.parent / "sweep_wall.json"
    wall = json.loads(wall_path.read_text())["wall_s"] if wall_path.is_file() else ""
    return {
        "name": planned["name"], "budget": planned["budget"], "params": params,
        "tokens": tokens, "flops": 6.0 * params * tokens, "loss": summary[loss_field],
        "final_loss": summary.get("final_loss"), "final_val_loss": summary.get("final_val_loss"),
        "total_params": summary["params"], "non_embedding_params": summary["non_embedding_params"],
        "flops_actual": summary.get("flops"), "steps": summary.get("steps"),
        "dim": planned["dim"], "num_layers": planned["num_layers"], "wall_s": wall,
        "run_dir": planned["run_dir"],
    }
