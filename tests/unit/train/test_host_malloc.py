"""The trainer's own host-allocator setting: large per-step tensors stop page-faulting in anew.

Measured in a fresh interpreter (the setting is process-wide and cannot be undone), through the
kernel's count of minor page faults while the same 64 MiB tensor is allocated, filled and freed
ten times: glibc's default maps and unmaps it each time (about 16k faults each round), the tuned
heap reuses the same pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from densetrain.config import JobConfig
from densetrain.train.host_malloc import tune_host_allocator

_PROBE = """
import json, resource, sys
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


def _faults(choice: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _PROBE, choice], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_stops_the_per_step_page_faults():
    system, tuned = _faults("system"), _faults("tuned")
    pages_per_round = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert system["faults"] > 5 * pages_per_round, system  # mapped afresh nearly every round
    assert tuned["faults"] < 2 * pages_per_round, tuned  # reused: about one round in ten
    assert "mmap_max=0" in tuned["note"]


def test_allocator_is_left_alone_where_it_does_not_apply(monkeypatch):
    assert "cuda" in tune_host_allocator("tuned", "cuda")
    assert "system" in tune_host_allocator("system", "cpu")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    assert "GLIBC_TUNABLES" in tune_host_allocator("tuned", "cpu")


def test_unknown_allocator_is_refused_naming_the_field():
    job = JobConfig()
    job.training.host_allocator = "jemalloc"
    with pytest.raises(ValueError, match=r"training\.host_allocator must be one of"):
        job.validate()
