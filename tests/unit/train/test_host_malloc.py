"""The trainer's own host-allocator setting: large per-step tensors stop page-faulting in anew.

Measured in fresh interpreters, through the kernel's count of minor page faults while the same
64 MiB tensor is allocated, filled and freed ten times: glibc's default maps and unmaps it each
time (about 16k faults each round), the tuned heap reuses the same pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from densetrain.config import JobConfig
from densetrain.testing import tiny_job_overrides
from densetrain.train.host_malloc import TUNED_GLIBC_TUNABLES, tune_host_allocator

_PROBE = """
import json, os, resource, sys
import torch
from densetrain.train.host_malloc import tune_host_allocator
note = tune_host_allocator(sys.argv[1], "cpu")
torch.ones(16 * 2**20)  # first touch, outside the count
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16 * 2**20)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"note": note, "faults": faults}))
"""
_PAGES_PER_ROUND = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")


def _faults(choice: str, tunables: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run([sys.executable, "-c", _PROBE, choice], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_only
def test_the_tunables_the_command_sets_stop_the_per_step_page_faults():
    system = _faults("system")
    assert system["faults"] > 5 * _PAGES_PER_ROUND, system  # mapped afresh nearly every round
    for _ in range(3):  # the address-space layout differs per process: every one must hold
        tuned = _faults("tuned", TUNED_GLIBC_TUNABLES)
        assert tuned["faults"] < 2 * _PAGES_PER_ROUND, tuned  # reused
        assert "GLIBC_TUNABLES" in tuned["note"]


@linux_only
def test_the_train_command_restarts_itself_with_the_tunables(tmp_path):
    """`densetrain train` (the console script, as under torchrun) runs with the tunables set
    although its environment had none; ``host_allocator=system`` keeps the defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    for choice, expected in (
            ("tuned", "host allocator: large blocks kept in the heap (GLIBC_TUNABLES set by "
                      "densetrain train at start)"),
            ("system", "host allocator: system defaults (training.host_allocator=system)")):
        overrides = tiny_job_overrides(
            cache_dir=str(tmp_path / "cache"), run_dir=str(tmp_path / choice),
            extra=("--training.steps=1", "--schedule.warmup_steps=0", "--checkpoint.enabled=false",
                   "--eval.interval=0",
                   "--eval.sample_tokens=0", f"--training.host_allocator={choice}"))
        out = subprocess.run([sys.executable, "-m", "densetrain", "train", *overrides],
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert expected in out.stderr, out.stderr[-2000:]


def test_the_restart_happens_before_torch_is_imported():
    """What `densetrain train` runs before it restarts itself (the CLI, the job config and
    ``host_malloc``) imports no torch: everything imported there would be imported again."""
    code = ("import sys\n"
            "from densetrain.cli.main import build_parser\n"
            "from densetrain.config import load_job_config\n"
            "from densetrain.train.host_malloc import restart_with_tuned_allocator\n"
            "build_parser(['train']); load_job_config(None, ['--training.steps=1'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_allocator_is_left_alone_where_it_does_not_apply(monkeypatch):
    assert "cuda" in tune_host_allocator("tuned", "cuda")
    assert "system" in tune_host_allocator("system", "cpu")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    monkeypatch.delenv("DENSETRAIN_TUNED_MALLOC", raising=False)
    assert tune_host_allocator("tuned", "cpu") == "host allocator: as set by GLIBC_TUNABLES"


def test_unknown_allocator_is_refused_naming_the_field():
    job = JobConfig()
    job.training.host_allocator = "jemalloc"
    with pytest.raises(ValueError, match=r"training\.host_allocator must be one of"):
        job.validate()
