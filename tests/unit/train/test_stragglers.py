"""Stragglers on two real gloo ranks: a rank that really sleeps after each step is named (rank,
host, factor, since which step) in the log, metrics.jsonl, the summary and `densetrain goodput`;
an even run names nobody. Plus the arithmetic and the config's range checks."""

from __future__ import annotations

import json
import time

import pytest

from densetrain.config.sections import FaultsConfig
from densetrain.errors import UserError
from densetrain.testing import run_distributed
from densetrain.train import Callback, read_metrics, train
from densetrain.train.stragglers import split_waiting

SLEEP_S = 0.25


class SleepOnRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` after every step from ``from_step`` on: a real slow
    rank (the others wait for it in the next step's gradient reduction)."""

    def __init__(self, rank: int, seconds: float, from_step: int) -> None:
        self.rank, self.seconds, self.from_step = rank, seconds, from_step

    def on_step_end(self, parts, progress, report) -> None:
        if parts.rank == self.rank and report.step >= self.from_step:
            time.sleep(self.seconds)


def _train_on_rank(rank: int, world_size: int, overrides: list[str], slow: bool) -> dict:
    from densetrain.config import load_job_config

    callbacks = [SleepOnRank(1, SLEEP_S, from_step=3)] if slow else []
    started = time.perf_counter()
    summary = train(load_job_config(None, overrides), callbacks=callbacks)
    summary["wall_s"] = time.perf_counter() - started
    return summary


COMMON = ["--training.steps=16", "--eval.interval=0", "--eval.sample_tokens=0",
          "--checkpoint.enabled=false", "--logging.plot=false", "--logging.log_interval=1",
          "--faults.straggler_interval=4", "--faults.straggler_steps=3",
          "--faults.straggler_factor=1.5"]


def _overrides(tiny_overrides, make_job, tmp_path, name: str, layout: list[str]) -> list[str]:
    cache = make_job(run="cache").data.cache_dir
    return tiny_overrides + COMMON + layout + [f"--data.cache_dir={cache}",
                                              f"--logging.run_dir={tmp_path / name}"]


def test_a_sleeping_rank_is_named(make_job, tiny_overrides, tmp_path, capfd) -> None:
    from densetrain.cli.main import main

    run_dir = tmp_path / "slow"
    overrides = _overrides(tiny_overrides, make_job, tmp_path, "slow",
                           ["--parallel.dp_replicate=2", "--parallel.dp_shard=1"])  # plain DDP
    results = run_distributed(_train_on_rank, 2, overrides, True, timeout=120)
    err = capfd.readouterr().err
    for summary in results:  # every rank reaches the same verdict
        named = summary["stragglers"]
        assert [s["rank"] for s in named] == [1], named
        assert named[0]["since_step"] >= 3 and named[0]["factor"] >= 1.5
        assert named[0]["host"]
        assert summary["collective_wait_s"] > SLEEP_S  # rank 0 waited for it, measured steps
    assert err.count("straggler: rank 1 (host ") == 1, err  # one line, on rank 0 only
    records = read_metrics(run_dir)
    flagged = [r for r in records if r.get("stragglers")]
    assert flagged and flagged[-1]["step"] == 16
    assert flagged[0]["stragglers"][0]["rank"] == 1
    assert not [r for r in records if r["step"] < 4 and r.get("stragglers")]
    lines = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    assert any(line.get("stragglers") for line in lines)
    assert main(["goodput", str(run_dir), "--no-plot"]) == 0
    out = capfd.readouterr().out
    assert "waiting in collectives" in out and "straggler: rank 1 (host " in out, out


def test_an_even_run_names_nobody(make_job, tiny_overrides, tmp_path, capfd) -> None:
    overrides = _overrides(tiny_overrides, make_job, tmp_path, "even",
                           ["--parallel.dp_shard=2"])  # FSDP: the step's start is the mark
    results = run_distributed(_train_on_rank, 2, overrides, False, timeout=120)
    for summary in results:
        assert summary["stragglers"] == []
    assert "straggler:" not in capfd.readouterr().err
    assert not [r for r in read_metrics(tmp_path / "even") if "stragglers" in r]
    # The cost: the measurement is on by default; its all-gather runs every 4 steps here.
    print(f"even 2-rank run: {results[0]['wall_s']:.2f} s, "
          f"collective_wait_s={results[0]['collective_wait_s']:.4f}")


def test_split_waiting_names_the_rank_the_others_waited_for() -> None:
    # rank 1 spent 0.3 s outside the collectives; rank 0 waited those 0.3 s in them
    timing = split_waiting(7, windows=[0.5, 0.5, 0.5], blocked=[0.4, 0.1, 0.4])
    assert timing.wait == pytest.approx([0.3, 0.0, 0.3])
    assert timing.compute == pytest.approx([0.2, 0.5, 0.2])
    assert timing.factors()[1] == pytest.approx(2.5)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("straggler_factor", 1.0, "faults.straggler_factor must be a finite number > 1"),
    ("straggler_factor", float("nan"), "faults.straggler_factor must be a finite number > 1"),
    ("straggler_steps", 0, "faults.straggler_steps must be an integer >= 1"),
    ("straggler_interval", -1, "faults.straggler_interval must be an integer >= 0"),
])
def test_straggler_fields_out_of_range(field, value, expected) -> None:
    with pytest.raises(UserError, match=expected) as error:
        FaultsConfig(**{field: value}).validate()
    assert "\n" not in str(error.value)
