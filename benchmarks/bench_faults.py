"""Overhead of the runtime fault checks against a training step, at their default intervals.

For a model built from a preset (default: the default job's ``tiny-llama`` at the default
job's batch, 16 sequences of 256 tokens) on one process, times: a training step (forward,
backward, AdamW); the cross-replica checksum of every parameter and optimizer state (its
all-gather is a few hundred int64s and is left out); the whole-state finiteness check before a
save; the spike detector's median/MAD over its window. Prints one Markdown row per check with
its share of step time at the default interval. Run it briefly on a shared machine: the
figures move with the load.

    .venv/bin/python benchmarks/bench_faults.py --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from densetrain.config.sections import FaultsConfig
from densetrain.models import Transformer, get_preset
from densetrain.train.faults import first_non_finite
from densetrain.train.sdc import checksums
from densetrain.train.spikes import SpikeDetector


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Measure and print the table rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(get_preset(args.preset).replace(max_seq_len=max(args.seq_len, 256)))
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1))

    def step() -> None:
        out = model(tokens[:, :-1], targets_BS=tokens[:, 1:])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up (and the optimizer state exists from here on)
    step_s = _median_seconds(step, args.steps)
    named = list(model.named_parameters()) + [
        (f"{i}.{k}", v) for i, state in enumerate(optimizer.state.values())
        for k, v in state.items() if v.dim() > 0
    ]
    checksum_s = _median_seconds(lambda: checksums(named), 5)

    def replay() -> None:  # the replay's extra work: one forward/backward and a gradient copy
        model(tokens[:, :-1], targets_BS=tokens[:, 1:]).loss.backward()
        [p.grad.clone() for p in model.parameters()]
        optimizer.zero_grad()

    replay_s = _median_seconds(replay, args.steps)
    tree = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    finite_s = _median_seconds(lambda: first_non_finite(tree), 5)
    cfg = FaultsConfig()
    detector = SpikeDetector(window=cfg.spike_window, threshold=cfg.spike_threshold,
                             min_deviation=cfg.spike_min_deviation, warmup_steps=0,
                             min_history=cfg.spike_min_history)
    for i in range(cfg.spike_window):
        detector.observe(i, 5.0 + 0.01 * (i % 7))
    spike_s = _median_seconds(lambda: detector.observe(10**6, 5.0), 50)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, step {step_s:.3f} s "
          f"(batch {args.batch} x {args.seq_len})")
    rows = [("replica checksum (params + AdamW states)", checksum_s, cfg.sdc_check_interval),
            ("replay: extra forward/backward + gradient copy", replay_s, 1000),
            ("finiteness check of the saved state", finite_s, 100),
            ("spike detector (median + MAD, window 100)", spike_s, 1)]
    print("| check | seconds | default interval (steps) | share of step time |")
    print("|---|---|---|---|")
    for name, seconds, interval in rows:
        share = 100 * seconds / (interval * step_s)
        print(f"| {name} | {seconds:.5f} | {interval} | {share:.3f}% |")


if __name__ == "__main__":
    main()
