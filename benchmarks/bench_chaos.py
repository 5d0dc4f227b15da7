"""Goodput under chaos: a 2-rank CPU run under torchrun, killed, hung and spiked while it trains.

Runs ``densetrain train`` (through this file's ``--worker`` mode, which adds timing probes and the
spike injector) on 2 gloo ranks under ``torchrun --standalone --nproc-per-node 2 --max-restarts N``
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/reliability.md "Automatic restart") for
``--minutes``, and meanwhile:

* every ``--kill-every`` seconds (uniform in the range, seeded RNG) ``kill -9`` a random worker;
* once (``--hang-at`` seconds in) ``SIGSTOP`` a random worker: a hang. The other rank's hang
  watchdog ends it (``faults.hang_min_seconds`` short), torchrun stops the group (SIGTERM, then
  SIGKILL after its 30 s shutdown timeout: a stopped process cannot act on SIGTERM) and restarts it;
* once (at step ``--spike-step``) multiply the learning rate of one step by ``--spike-factor``
  (a test callback: there is no loss-spike injection hook in the CLI). The update of that step
  wrecks the weights, the loss of the next steps spikes, the spike detector rolls back to a
  checkpoint at least ``faults.rollback_min_steps`` earlier and skips
  ``faults.rollback_skip_batches`` batches (recorded in ``run_history.jsonl``).

The driver probes the CPU's peak once and pins it for every worker (``logging.peak_tflops``,
`cpu_peak_tflops`), so restarted processes do not each probe it again.

The lr override was chosen over a corrupted batch because it spikes the loss through the weights,
as a real divergence does, without touching the data stream, so the reference run only has to skip
the sequences the rollback skipped (``faults.skip_sequences``), not reproduce a corrupted batch.

At the end (time up: SIGTERM to torchrun, the run saves and stops; or the run finished) it reports
goodput from the run's own ledger (``densetrain goodput``), the recovery of each fault split into
detection/restart (torchrun), interpreter start and imports, build (process group, model, data),
checkpoint load, first step (data + the step itself), the largest share of lost time, and compares
the weights with an undisturbed reference run of the same config that skips the same sequences,
trained to the same step (``--check-step``: an earlier checkpoint of the chaos run, cheaper).

    .venv/bin/python benchmarks/bench_chaos.py --minutes 20 --out /tmp/chaos
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ~0.1-0.3 s per step on 2 CPU ranks (2 vCPU host, 1 thread per rank).
MODEL = [
    "--model.dim=128", "--model.embed_dim=128", "--model.head_dim=32", "--model.num_layers=4",
    "--model.num_heads=4", "--model.num_kv_heads=2", "--model.ffn_dim=384",
    "--data.seq_len=128", "--data.default_max_files=200", "--data.default_vocab_size=2048",
    "--data.default_val_fraction=0.05", "--training.global_batch_size=8",
    "--training.micro_batch_size=4", "--schedule.warmup_steps=50", "--optim.lr=1e-3",
    "--eval.interval=0", "--eval.sample_tokens=0", "--checkpoint.keep_last=0",
    "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
    "--logging.plot=false",
]


def faults_overrides(args) -> list[str]:
    """Short watchdog and collective timeouts, a spike detector armed early."""
    return [
        f"--faults.hang_min_seconds={args.hang_seconds}",
        f"--faults.hang_first_steps_seconds={max(args.hang_seconds, 60)}",
        f"--parallel.collective_timeout_s={args.collective_timeout}",
        "--faults.spike_warmup_steps=60", "--faults.spike_min_history=20",
        "--faults.spike_window=50", f"--faults.rollback_min_steps={args.rollback_min_steps}",
        f"--faults.rollback_skip_batches={args.rollback_skip_batches}",
        "--faults.divergence_margin=0",
    ]


# --------------------------------------------------------------------------- worker side


def _proc_start_time(pid: int | str = "self") -> float:
    """The wall time the process ``pid`` was created (from /proc), as time.time(). The boot
    time is now minus /proc/uptime (10 ms resolution), not /proc/stat's ``btime``, which is
    whole seconds: a restart within a second of a fault would otherwise seem to precede it."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def worker(argv: list[str]) -> int:
    """One rank: probes around build and resume, the spike injector, then `train`."""
    t_import0 = time.time()
    probe_path = Path(os.environ["CHAOS_PROBES"])
    rank = int(os.environ.get("RANK", "0"))

    def probe(event: str, **extra) -> None:
        with open(probe_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank": rank, "event": event,
                                "t": time.time(), **extra}) + "\n")

    probe("proc_start", t_proc=_proc_start_time(), t_main=t_import0,
          restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    import torch

    import densetrain.train.setup as setup
    import densetrain.train.trainer as trainer
    from densetrain.config import load_job_config
    from densetrain.train import Callback

    torch.set_num_threads(1)
    probe("imported")
    spike_step = int(os.environ.get("CHAOS_SPIKE_STEP", "0"))
    spike_factor = float(os.environ.get("CHAOS_SPIKE_FACTOR", "300"))

    real_build, real_resume = setup.build_run, trainer.resume

    def build_run(job):
        probe("build_start")
        out = real_build(job)
        probe("build_end")
        return out

    def resume(parts, progress, **kw):
        probe("load_start")
        out = real_resume(parts, progress, **kw)
        probe("load_end", step=progress.step, checkpoint=out)
        return out

    setup.build_run, trainer.resume = build_run, resume

    class Probe(Callback):
        """Stamps the first step of this process and injects the spike once per run."""

        def __init__(self) -> None:
            self.first = True

        def on_step_end(self, parts, progress, report) -> None:
            if self.first:
                self.first = False
                probe("first_step", step=progress.step)
            marker = parts.run_dir / f"chaos_spike_injected.rank{parts.rank}"
            if spike_step and progress.step == spike_step and not marker.exists():
                opt = getattr(parts.optimizer, "torch_optimizer", parts.optimizer)
                for group in opt.param_groups:  # the scheduler resets it after the next step
                    group["lr"] *= spike_factor
                marker.write_text(str(time.time()))
                probe("spike_injected", step=progress.step)

        def on_rollback(self, parts, progress) -> None:
            probe("rollback", step=progress.step)

    job = load_job_config(None, argv)
    probe("train_called")
    summary = trainer.train(job, callbacks=[Probe()])
    probe("train_returned", step=summary.get("steps"), preempted=summary.get("preempted"))
    return 0


# --------------------------------------------------------------------------- driver side


def workers_of(agent: int) -> list[int]:
    """The worker pids of the torchrun agent ``agent`` (its direct children)."""
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent)], capture_output=True,
                             text=True, check=False).stdout
    except OSError:
        return []
    return [int(p) for p in out.split()]


def torchrun_cmd(args, overrides: list[str], max_restarts: int) -> list[str]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts",
            str(max_restarts), "--monitor-interval", "0.5", str(Path(__file__).resolve()),
            "--worker", *overrides]


def launch(args, overrides, probes: Path, log: Path, *, spike_step: int, max_restarts: int):
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", CHAOS_PROBES=str(probes),
               CHAOS_SPIKE_STEP=str(spike_step), CHAOS_SPIKE_FACTOR=str(args.spike_factor),
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen(torchrun_cmd(args, overrides, max_restarts), env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def chaos(args, overrides, out: Path) -> tuple[list[dict], int, float, float]:
    """Run the job under faults; returns (faults injected, torchrun rc, start, end)."""
    rng = random.Random(args.seed)
    probes = out / "probes.jsonl"
    agent = launch(args, overrides, probes, out / "chaos.log", spike_step=args.spike_step,
                   max_restarts=args.max_restarts)
    start = time.time()
    deadline = start + 60 * args.minutes
    lo, hi = args.kill_every
    next_kill = start + rng.uniform(lo, hi)
    hang_at = start + args.hang_at
    hung = False
    injected: list[dict] = []
    while agent.poll() is None and time.time() < deadline:
        time.sleep(0.5)
        now = time.time()
        pids = workers_of(agent.pid)
        if len(pids) < 2:
            continue
        if not hung and now >= hang_at and now < deadline - 90:
            victim = rng.choice(sorted(pids))
            os.kill(victim, signal.SIGSTOP)
            injected.append({"kind": "SIGSTOP (hang)", "t": now, "pid": victim})
            print(f"[chaos] {now - start:7.1f} s SIGSTOP {victim}", flush=True)
            hung = True
            next_kill = max(next_kill, now + lo)
        elif now >= next_kill and now < deadline - 60:
            victim = rng.choice(sorted(pids))
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            injected.append({"kind": "kill -9", "t": now, "pid": victim})
            print(f"[chaos] {now - start:7.1f} s kill -9 {victim}", flush=True)
            next_kill = now + rng.uniform(lo, hi)
    if agent.poll() is None:  # time up: the run saves a checkpoint and stops (preemption)
        os.kill(agent.pid, signal.SIGTERM)
        try:
            agent.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop_all(agent)
    return injected, agent.returncode, start, time.time()


def cpu_peak_tflops() -> float:
    """This CPU's fp32 matmul peak at 1 thread, probed once by the driver and pinned for every
    worker (``logging.peak_tflops``), as a production job pins its device's peak (a GPU's
    comes from densetrain's table at no cost): otherwise each restarted process spends ~0.6 s
    probing the CPU again before its first step, a cost of CPU runs only."""
    import torch

    from densetrain.train.metrics import measure_cpu_peak_flops

    torch.set_num_threads(1)
    return measure_cpu_peak_flops("fp32") / 1e12


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def recoveries(injected: list[dict], probes: list[dict], ledger: list[dict]) -> list[dict]:
    """Per fault: seconds from the fault to each milestone of the next group's rank 0, and the
    steps it had to recompute (the step reached before the fault minus the resumed step)."""
    starts = sorted((p for p in probes if p["event"] == "proc_start" and p["rank"] == 0),
                    key=lambda p: p["t"])
    by_pid: dict[int, dict[str, float]] = {}
    for p in probes:
        by_pid.setdefault(p["pid"], {}).setdefault(p["event"], p["t"])
    result = []
    for fault in injected:
        after = [s for s in starts if s["t"] > fault["t"]]  # main() ran after the fault
        if not after:
            result.append({**fault, "recovered": False})
            continue
        nxt = after[0]
        ev = by_pid.get(nxt["pid"], {})
        t0 = fault["t"]
        row = {**fault, "recovered": "first_step" in ev,
               # detection + group stop + new processes (to their creation, /proc)
               "restart_s": max(nxt["t_proc"] - t0, 0.0),
               "imports_s": ev.get("imported", nxt["t_proc"]) - max(nxt["t_proc"], t0),
               "build_s": ev.get("build_end", 0) - ev.get("train_called", 0),
               "load_s": ev.get("load_end", 0) - ev.get("load_start", 0),
               "first_step_s": ev.get("first_step", 0) - ev.get("load_end", 0),
               "total_s": ev.get("first_step", t0) - t0}
        row["resumed_step"] = next((p.get("step") for p in probes if p["pid"] == nxt["pid"]
                                    and p["event"] == "load_end"), None)
        before = [int(e["step"]) for e in ledger if float(e["end"]) <= t0]
        row["step_at_fault"] = max(before, default=0)
        row["recomputed_steps"] = row["step_at_fault"] - (row["resumed_step"] or 0)
        result.append(row)
    return result


def spike_recovery(history: list[dict]) -> list[dict]:
    return [{"kind": "loss spike (lr x factor for one step)", "spike_step": h["spike_step"],
             "to_step": h["to_step"], "skip": h["skip"], "loss": h.get("loss"),
             "median": h.get("median")}
            for h in history if h.get("event") == "rollback"]


def reference_run(args, overrides, out: Path, skip: str, step: int) -> Path:
    """An undisturbed run of the same job, skipping ``skip``, to ``step``; its run dir."""
    run_dir = out / "reference"
    extra = [f"--logging.run_dir={run_dir}", f"--checkpoint.interval={step}"]
    if skip:
        extra.append(f"--faults.skip_sequences={skip}")
    probes = out / "reference_probes.jsonl"
    agent = launch(args, overrides + extra, probes, out / "reference.log", spike_step=0,
                   max_restarts=0)
    ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    while agent.poll() is None:
        time.sleep(1)
        if any(json.loads(line).get("step", 0) >= step
               for line in _tail(run_dir / "metrics.jsonl")) and _complete(ckpt):
            time.sleep(2)
            break
    stop_all(agent)
    return run_dir


def stop_all(agent: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers: they run in sessions of their own (torch elastic
    starts them with start_new_session), so killing the agent's group would orphan them."""
    for pid in workers_of(agent.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def _tail(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line for line in path.read_text().splitlines()[-3:] if line.strip().startswith("{")]


def _complete(ckpt: Path) -> bool:
    return ckpt.is_dir() and any(ckpt.glob("*.metadata")) or (ckpt / ".metadata").is_file()


def load_weights(ckpt: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = ckpt.parent.parent.parent / f"_{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(tmp))
    state = torch.load(tmp, weights_only=False)
    tmp.unlink()
    model = state.get("model", state)
    return {k: v for k, v in _flat(model).items() if hasattr(v, "shape")}


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=0,
                   help="training.steps (default: minutes × 60 / 0.1 s, more than the ~0.15 s "
                        "steps of an idle 2-core host fit: the run is stopped at the deadline)")
    p.add_argument("--kill-every", type=float, nargs=2, default=(120.0, 180.0),
                   metavar=("LO", "HI"), help="seconds between kill -9s, uniform")
    p.add_argument("--hang-at", type=float, default=0.0,
                   help="seconds in to SIGSTOP a worker (default: 45%% of the duration)")
    p.add_argument("--spike-step", type=int, default=0,
                   help="step whose next step runs at lr × --spike-factor (default: the step "
                        "reached at 20%% of the duration at 0.3 s/step, at least 150)")
    p.add_argument("--spike-factor", type=float, default=300.0)
    p.add_argument("--hang-seconds", type=float, default=8.0, help="faults.hang_min_seconds")
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="parallel.collective_timeout_s")
    p.add_argument("--checkpoint-interval", default="auto")
    p.add_argument("--rollback-min-steps", type=int, default=20)
    p.add_argument("--rollback-skip-batches", type=int, default=40)
    p.add_argument("--max-restarts", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-step", type=int, default=0,
                   help="compare weights at this checkpoint step of the chaos run (default: its "
                        "last); the reference run trains to it")
    p.add_argument("--reference-minutes", type=float, default=0.0,
                   help="without --check-step: compare at the last checkpoint the reference run "
                        "reaches in about this many minutes (at the chaos run's productive step "
                        "rate) instead of the final one (0: the final one)")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_chaos"))
    args = p.parse_args()
    steps = args.steps or int(args.minutes * 60 / 0.1)  # more than fit: the deadline ends it
    args.hang_at = args.hang_at or 0.45 * args.minutes * 60
    args.spike_step = args.spike_step or max(150, int(args.minutes * 60 * 0.2 / 0.3))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("probes.jsonl", "reference_probes.jsonl"):
        (out / stale).unlink(missing_ok=True)
    run_dir = out / "run"
    if run_dir.exists() or (out / "reference").exists():
        sys.exit(f"{run_dir} or {out / 'reference'} exists: give a fresh --out")
    cache = out / "cache"
    overrides = MODEL + ["--parallel.dp_shard=2"] + faults_overrides(args) + [
        f"--training.steps={steps}", f"--data.cache_dir={cache}",
        f"--logging.peak_tflops={cpu_peak_tflops():.6g}"]
    chaos_overrides = overrides + [f"--logging.run_dir={run_dir}",
                                   f"--checkpoint.interval={args.checkpoint_interval}"]
    if args.checkpoint_interval == "auto":
        # Young's interval needs the failure rate: the prior MTBF of one device is the chaos
        # rate (a fault every mean kill interval on one of 2 ranks), not a fleet's 45,000 h.
        mtbf_h = 2 * sum(args.kill_every) / 2 / 3600
        chaos_overrides += [f"--checkpoint.mtbf_prior_device_hours={mtbf_h:.4f}",
                            "--checkpoint.auto_initial_interval=50",
                            "--checkpoint.auto_min_interval=10"]
    print(f"[chaos] {args.minutes} min, steps={steps}, spike after step {args.spike_step}, "
          f"hang at {args.hang_at:.0f} s, kills every {args.kill_every} s, seed {args.seed}",
          flush=True)
    # the corpus is prepared once, before the clock starts
    subprocess.run([sys.executable, "-m", "densetrain", "train", *MODEL,
                    f"--data.cache_dir={cache}", "--training.steps=1", "--schedule.warmup_steps=0",
                    "--checkpoint.enabled=false",
                    f"--logging.run_dir={out / 'warm'}"],
                   env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    injected, rc, start, end = chaos(args, chaos_overrides, out)
    probes = read_jsonl(out / "probes.jsonl")
    # rollbacks are events of faults.jsonl (older runs: run_history.jsonl)
    history = read_jsonl(run_dir / "faults.jsonl") + read_jsonl(run_dir / "run_history.jsonl")
    goodput = subprocess.run([sys.executable, "-m", "densetrain", "goodput", str(run_dir),
                              "--no-plot"], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    from densetrain.train.goodput import ledger_totals, read_ledger

    lines = read_ledger(run_dir)
    totals, wall = ledger_totals(lines)
    first_proc = min(p["t_proc"] for p in probes if p["event"] == "proc_start")
    # time before the ledger's first line (first interpreter start, imports) is not in it
    pre = float(min(e["start"] for e in lines)) - first_proc
    report = {
        "torchrun_rc": rc, "bench_wall_s": end - start, "ledger_wall_s": wall,
        "pre_ledger_s": pre, "buckets_s": totals,
        "goodput_ledger": totals["productive"] / wall,
        "goodput_from_first_process": totals["productive"] / (wall + pre),
        "steps_reached": max(int(e["step"]) for e in lines),
        "faults": recoveries(injected, probes, lines),
        "spikes": spike_recovery(history),
        "restarts": len({p["pid"] for p in probes if p["event"] == "proc_start"
                         and p["rank"] == 0}) - 1,
        "checkpoint_steps": sorted(int(d.name.split("-")[1])
                                   for d in (run_dir / "checkpoints").glob("step-*")),
    }
    lost = {k: v for k, v in totals.items() if k != "productive"}
    report["largest_lost"] = max(lost, key=lost.get)
    report["lost_shares"] = {k: v / wall for k, v in sorted(lost.items(), key=lambda kv: -kv[1])}
    print(goodput.stdout)
    if not args.no_reference:
        report["weights"] = weights_check(args, overrides, out, run_dir, report)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    return 0


def weights_check(args, overrides, out: Path, run_dir: Path, report: dict) -> dict:
    import torch

    steps = report["checkpoint_steps"]
    step = args.check_step or (steps[-1] if steps else 0)
    if not args.check_step and args.reference_minutes and steps:
        rate = report["steps_reached"] / max(report["buckets_s"]["productive"], 1e-9)
        reachable = [s for s in steps if s <= rate * 60 * args.reference_minutes]
        step = reachable[-1] if reachable else steps[0]
    if step not in steps:
        return {"error": f"no checkpoint of step {step} in the chaos run (have {steps})"}
    skip = ",".join(f"{a}:{b}" for a, b in (s["skip"] for s in report["spikes"]))
    t0 = time.time()
    ref_dir = reference_run(args, overrides, out, skip, step)
    ref_s = time.time() - t0
    mine = load_weights(run_dir / "checkpoints" / f"step-{step:08d}")
    ref = load_weights(ref_dir / "checkpoints" / f"step-{step:08d}")
    differ = [k for k in mine if k not in ref or not torch.equal(mine[k], ref[k])]
    max_abs = max((float((mine[k] - ref[k]).abs().max()) for k in differ if k in ref),
                  default=0.0)
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")
              if "loss" in r}
    ref_losses = {r["step"]: r["loss"] for r in read_jsonl(ref_dir / "metrics.jsonl")
                  if "loss" in r}
    common = sorted(set(losses) & set(ref_losses))
    loss_diff = [s for s in common if losses[s] != ref_losses[s]]
    return {"step": step, "skip_sequences": skip, "tensors": len(mine),
            "tensors_differing": len(differ), "max_abs_diff": max_abs,
            "identical": not differ and len(mine) == len(ref) and len(mine) > 0,
            "common_loss_steps": len(common), "loss_steps_differing": len(loss_diff),
            "first_loss_diff_step": loss_diff[0] if loss_diff else None,
            "reference_seconds": ref_s}


if __name__ == "__main__":
    sys.exit(main())
