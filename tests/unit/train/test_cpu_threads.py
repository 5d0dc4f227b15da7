"""Each CPU rank's threads fit its share of the host's cores (`train.device.tune_cpu_threads`):
cut to ``cores // LOCAL_WORLD_SIZE`` when ``OMP_NUM_THREADS`` is unset and the process would run
more; kept when it is set, with a note when it asks for more than the share or leaves half the
cores idle. Checked on torch's own thread count, and through two real ranks of ``densetrain
train`` started without torchrun, whose matmul probe reports the threads it ran with."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from densetrain.train.device import available_cores, tune_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_ranks_without_omp_num_threads_are_cut_to_their_share(restore_threads) -> None:
    torch.set_num_threads(8)
    line = tune_cpu_threads("cpu", {"LOCAL_WORLD_SIZE": "4"}, cores=16)
    assert torch.get_num_threads() == 4
    assert line == ("cpu threads: 4 per rank (16 cores for 4 ranks on this host; "
                    "OMP_NUM_THREADS sets another count)")


def test_a_process_within_its_share_is_left_alone(restore_threads) -> None:
    torch.set_num_threads(2)
    assert tune_cpu_threads("cpu", {}, cores=2) == "cpu threads: 2 per process (2 cores)"
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    line = tune_cpu_threads("cpu", {"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}, cores=2)
    assert line == ("cpu threads: 1 per rank (2 cores for 4 ranks on this host: more ranks "
                    "than cores; OMP_NUM_THREADS=1)")
    assert torch.get_num_threads() == 1


def test_a_set_omp_num_threads_is_kept_and_an_oversubscription_noted(restore_threads) -> None:
    torch.set_num_threads(4)
    line = tune_cpu_threads("cpu", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "4"}, cores=4)
    assert torch.get_num_threads() == 4
    assert line == ("note: OMP_NUM_THREADS=4 runs 2 ranks x 4 threads on 4 cores, more "
                    "threads than cores; OMP_NUM_THREADS=2 fits this host")


def test_torchruns_one_thread_on_a_large_host_is_noted(restore_threads) -> None:
    torch.set_num_threads(1)
    line = tune_cpu_threads("cpu", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, cores=16)
    assert torch.get_num_threads() == 1
    assert line == ("note: OMP_NUM_THREADS=1 (torchrun sets 1 when it is unset) keeps 2 of the "
                    "16 cores busy (2 ranks x 1); OMP_NUM_THREADS=8 uses them all")


@pytest.mark.parametrize("bad", ["abc", "0", "-2"])
def test_a_bad_local_world_size_is_refused_by_name(restore_threads, bad) -> None:
    with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE must be an integer >= 1 .*'{bad}'"):
        tune_cpu_threads("cpu", {"LOCAL_WORLD_SIZE": bad}, cores=2)


def test_accelerator_runs_are_not_touched(restore_threads) -> None:
    torch.set_num_threads(3)
    assert tune_cpu_threads("cuda", {"LOCAL_WORLD_SIZE": "8"}, cores=2) is None
    assert torch.get_num_threads() == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_started_without_torchrun_each_take_half_the_cores(make_job, tmp_path) -> None:
    from densetrain.testing import TINY_OVERRIDES

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    default = int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
        capture_output=True, text=True, check=True).stdout)
    expected = min(default, max(1, available_cores() // 2))
    cache = make_job().data.cache_dir
    args = [sys.executable, "-m", "densetrain", "train", *TINY_OVERRIDES,
            f"--data.cache_dir={cache}", f"--logging.run_dir={tmp_path / 'run'}",
            "--training.steps=1", "--schedule.warmup_steps=0", "--checkpoint.enabled=false",
            "--eval.interval=0", "--eval.sample_tokens=0", "--logging.plot=false",
            "--training.device=cpu"]
    port = str(_free_port())
    ranks = [
        subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                    "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs[0][1][-3000:]
    stderr = outputs[0][1]
    assert re.search(rf"^cpu threads: {expected} per rank \(\d+ cores for 2 ranks on this host",
                     stderr, re.M), stderr[-3000:]
    # the matmul probe ran after the cut, with the rank's threads
    assert f"matmul runs, {expected} threads" in stderr
    assert Path(tmp_path / "run" / "metrics.jsonl").exists()
