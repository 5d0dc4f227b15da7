"""Two "nodes" on one machine: two torchrun agents (``--nnodes 2``, c10d rendezvous on
127.0.0.1, 2 workers each, one ``--rdzv-id``) train the tiny job on gloo, and one whole node
(its agent and its workers) is killed with SIGKILL.

* killed during a step, or during a checkpoint save, and replaced by a new agent: the agents
  re-form the group (``--max-restarts``), the run resumes from the last verified checkpoint,
  and its losses are bit-identical to an undisturbed run's;
* elastic shrink (``--nnodes 1:2``), the node lost for good: the survivor goes on alone at
  world size 2, resharded from the checkpoint, with the same global batch (twice the gradient
  accumulation), the same samples per step, and the change in ``run_history.jsonl``;
* a TP degree that no longer fits the shrunken world stops in one message naming it.

The agent that binds the rendezvous endpoint serves the rendezvous store (as node 0 of a real
job does), so it is started first and node 1 is the one killed. torchrun starts each worker in
a session of its own: killing a node is killing the agent's process group and every worker's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import faultkit
import pytest

STEPS = 20
GBS = 8
JOB = [f"--training.steps={STEPS}", f"--training.global_batch_size={GBS}",
       "--training.micro_batch_size=2", "--checkpoint.keep_last=0",
       # a lost peer is found by gloo (connection reset) or at the latest by these
       "--parallel.collective_timeout_s=30", "--faults.hang_min_seconds=20",
       "--faults.hang_first_steps_seconds=60"]
SHRINK_TOLERANCE = 1e-5
"""Relative tolerance of losses after a 4 -> 2 shrink (gradient norms: 10x): the same samples,
but the gradients are summed over 2 ranks x 2 micro-batches instead of 4 ranks x 1, in another
order, and float addition is not associative. Trials: losses within 1e-7, norms 4.5e-6; another
batch would differ by about 1e-2."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class TwoNodes:
    """One job's agents: `start` one node (a torchrun agent), `kill_node` one with its workers."""

    def __init__(self, cache: str, run_dir: Path, *extra: str, nnodes: str = "2",
                 restarts: int = 1) -> None:
        self.run_dir, self.port = run_dir, _free_port()
        self.log_dir = run_dir.parent / f"{run_dir.name}-agents"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.command = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=two-nodes-{self.port}",
            "--rdzv-conf=join_timeout=60,last_call_timeout=1,close_timeout=5",
            "--monitor-interval=1", f"--max-restarts={restarts}",
            "-m", "densetrain", "train", *faultkit.overrides(cache, run_dir, *JOB, *extra)]
        # The workers' process group does not reuse the agents' store (pytorch/pytorch#135712).
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        self.agents: list[subprocess.Popen] = []

    def start(self) -> subprocess.Popen:
        """One more node; the first is awaited until it serves the rendezvous store."""
        log = open(self.log_dir / f"agent{len(self.agents)}.log", "w")
        agent = subprocess.Popen(self.command, env=self.env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.agents.append(agent)
        if len(self.agents) == 1:
            _wait(lambda: _listening(self.port), self, "the rendezvous store to listen")
        return agent

    def start_all(self) -> TwoNodes:
        self.start()
        self.start()
        return self

    def kill_node(self, agent: subprocess.Popen) -> None:
        """SIGKILL the agent's process group and each of its workers' (their own sessions)."""
        workers = faultkit.children(agent.pid)
        for group in [agent.pid, *workers]:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()

    def log(self, index: int) -> str:
        return (self.log_dir / f"agent{index}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- agent {i}\n{self.log(i)[-4000:]}" for i in range(len(self.agents)))

    def wait(self, timeout: float = 400) -> list[int]:
        """Every agent's exit status (the killed ones' included)."""
        deadline = time.monotonic() + timeout
        codes = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.stop()
                message = f"agents still running after {timeout} s\n{self.logs()}"
                raise AssertionError(message) from None
        return codes

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                self.kill_node(agent)


def _wait(condition, nodes: TwoNodes, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [a.returncode for a in nodes.agents if a.poll() is not None]
        assert not dead, f"an agent ended ({dead}) while waiting for {what}\n{nodes.logs()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{nodes.logs()}"
        time.sleep(0.01)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p.parent for p in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def _run(nodes: TwoNodes) -> TwoNodes:
    nodes.start_all()
    codes = nodes.wait()
    assert codes == [0, 0], nodes.logs()
    return nodes


def _consumed(checkpoint: Path) -> tuple[int, int]:
    """(trainer step, data samples consumed) saved in a checkpoint."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys({"trainer.step", "data.consumed_sequences"},
                                           checkpoint_id=str(checkpoint))
    return int(state["trainer"]["step"]), int(state["data"]["consumed_sequences"])


LAYOUTS = {"fsdp4": [], "tp2-fsdp2": ["--parallel.tp=2"]}
"""Layouts of the four ranks: FSDP over 4 (dp_shard=-1), and TP 2 x FSDP 2."""


@pytest.fixture(scope="module")
def straight(fault_cache, tmp_path_factory):
    """``straight(layout)``: the undisturbed two-node run's curve in that layout (run once per
    module; the checkpoint cadence does not change it)."""
    curves: dict[str, list[tuple]] = {}

    def curve_of(layout: str) -> list[tuple]:
        if layout not in curves:
            run_dir = tmp_path_factory.mktemp(f"two-nodes-straight-{layout}") / "run"
            _run(TwoNodes(fault_cache, run_dir, "--checkpoint.interval=3", *LAYOUTS[layout],
                          restarts=0))
            curves[layout] = faultkit.curve(run_dir)
            assert [s for s, _, _ in curves[layout]] == list(range(1, STEPS + 1))
        return curves[layout]

    return curve_of


def _kill_and_replace(nodes: TwoNodes, when) -> tuple[int, int]:
    """Kill node 1 once ``when()`` holds and start a replacement; (the step logged at the kill,
    the newest complete checkpoint's step then)."""
    nodes.start_all()
    try:
        _wait(when, nodes, "the moment to kill node 1")
        nodes.kill_node(nodes.agents[1])
        killed_at = faultkit.logged_steps(nodes.run_dir)
        complete = _checkpoints(nodes.run_dir)
        nodes.start()  # the replacement node
        codes = nodes.wait()
    finally:
        nodes.stop()
    assert codes[0] == 0 and codes[2] == 0, (codes, nodes.logs())
    return killed_at, int(complete[-1].name[5:]) if complete else 0


def _resumed_step(nodes: TwoNodes) -> int:
    """The step of the one checkpoint the run resumed from (a complete one). Rank 0, which
    prints it, may be on the replacement node: the re-formed group ranks nodes anew."""
    resumed = [line for i in range(len(nodes.agents)) for line in nodes.log(i).splitlines()
               if line.startswith("resumed from")]
    assert len(resumed) == 1, nodes.logs()
    path = Path(resumed[0].split()[2])
    assert path.name.startswith("step-") and not path.name.endswith(".tmp"), resumed
    assert (path / "manifest.json").is_file()
    return int(path.name[5:])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_node_killed_during_a_step_and_replaced_resumes_bit_identically(
        fault_cache, straight, layout, tmp_path) -> None:
    run_dir = tmp_path / "run"
    nodes = TwoNodes(fault_cache, run_dir, "--checkpoint.interval=3", *LAYOUTS[layout])
    killed_at, newest = _kill_and_replace(
        nodes, lambda: faultkit.logged_steps(run_dir) >= 5 and _checkpoints(run_dir))
    assert killed_at < STEPS
    assert newest <= _resumed_step(nodes) <= killed_at  # the last verified checkpoint
    assert "world size changed" not in nodes.logs()
    assert faultkit.curve(run_dir) == straight(layout)


@pytest.mark.slow
def test_a_node_killed_during_a_save_and_replaced_resumes_bit_identically(
        fault_cache, straight, tmp_path) -> None:
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    nodes = TwoNodes(fault_cache, run_dir, "--checkpoint.interval=1")
    killed_at, newest = _kill_and_replace(
        nodes, lambda: faultkit.logged_steps(run_dir) >= 4 and list(checkpoints.glob("*.tmp")))
    assert newest <= _resumed_step(nodes) <= killed_at  # not the save cut short
    assert faultkit.curve(run_dir) == straight("fsdp4")


@pytest.mark.slow
def test_elastic_shrink_goes_on_alone_at_world_size_two_with_the_same_batches(
        fault_cache, straight, tmp_path) -> None:
    run_dir = tmp_path / "run"
    nodes = TwoNodes(fault_cache, run_dir, "--checkpoint.interval=3", nnodes="1:2")
    nodes.start_all()
    try:
        _wait(lambda: faultkit.logged_steps(run_dir) >= 5 and _checkpoints(run_dir), nodes,
              "step 5 and a checkpoint")
        nodes.kill_node(nodes.agents[1])  # lost for good: no replacement
        codes = nodes.wait()
    finally:
        nodes.stop()
    assert codes[0] == 0, nodes.logs()
    log = nodes.log(0)
    changes = [e for e in faultkit.history(run_dir) if e["event"] == "world_size_changed"]
    assert len(changes) == 1 and (changes[0]["from"], changes[0]["to"]) == (4, 2), changes
    resumed_step = changes[0]["step"]
    assert 3 <= resumed_step < STEPS and resumed_step % 3 == 0
    assert "this run has 2 (resharded on load)" in log
    assert "4 process(es)" in log and "2 process(es)" in log  # both worlds trained
    # The same global batch: step k reads the samples [GBS (k - 1), GBS k) at either world
    # size (no skip ranges), so every checkpoint holds GBS x its step as consumed samples.
    after = [c for c in _checkpoints(run_dir) if int(c.name[5:]) > resumed_step]
    assert after and all(consumed == GBS * step for step, consumed in map(_consumed, after))
    curve, reference = faultkit.curve(run_dir), straight("fsdp4")
    assert [s for s, _, _ in curve] == [s for s, _, _ in reference]
    for (step, loss, grad), (_, want_loss, want_grad) in zip(curve, reference, strict=True):
        if step <= resumed_step:
            assert (loss, grad) == (want_loss, want_grad), step  # logged before the shrink
        else:
            assert loss == pytest.approx(want_loss, rel=SHRINK_TOLERANCE, abs=0), step
            assert grad == pytest.approx(want_grad, rel=SHRINK_TOLERANCE * 10, abs=0), step


def test_a_tp_degree_that_no_longer_fits_the_shrunken_world_is_named_before_any_step(
        fault_cache, tmp_path) -> None:
    """TP 4 on 4 ranks; node 1 lost for good: at world size 2 the restart stops at setup."""
    run_dir = tmp_path / "run"
    nodes = TwoNodes(fault_cache, run_dir, "--parallel.tp=4", "--model.num_kv_heads=4",
                     "--training.steps=1000", "--checkpoint.enabled=false", nnodes="1:2")
    nodes.start_all()
    try:
        _wait(lambda: faultkit.logged_steps(run_dir) >= 1, nodes, "step 1")
        nodes.kill_node(nodes.agents[1])
        steps_before = faultkit.logged_steps(run_dir)
        codes = nodes.wait(timeout=200)
    finally:
        nodes.stop()
    assert codes[0] != 0
    log = nodes.log(0)
    restarted = log.split("failed at step")[-1]  # what the restarted workers printed
    errors = [line for line in restarted.splitlines()
              if line.startswith("densetrain train: error:")]
    assert errors and len(set(errors)) == 1, log[-4000:]
    assert "tp=4" in errors[0] and "world size 2" in errors[0], errors[0]
    assert faultkit.logged_steps(run_dir) == steps_before  # no step at world size 2
