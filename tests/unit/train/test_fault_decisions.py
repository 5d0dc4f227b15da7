"""`FaultGuard.after_step` decides (CONTINUE, ROLL_BACK, STOP) and loads nothing; `RunLoop`
acts on the decision: callbacks flushed, then the checkpoint session, then the guard told what
was restored. Expectations are computed by hand from the configured numbers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from densetrain.config.sections import FaultsConfig
from densetrain.train.callbacks import Callback
from densetrain.train.fault_record import FaultRecord, read_history
from densetrain.train.faults import (
    CONTINUE,
    Act,
    Decision,
    FaultGuard,
    RunFaultError,
    SilentDataCorruptionError,
)
from densetrain.train.state import StepReport
from densetrain.train.trainer import RunLoop


def _config(**overrides) -> FaultsConfig:
    settings = dict(spike_window=8, spike_threshold=6.0, spike_min_deviation=0.01,
                    spike_warmup_steps=0, spike_min_history=4, divergence_margin=0.0,
                    rollback_min_steps=2, rollback_skip_batches=3, max_rollbacks=3,
                    rollback_window_steps=1000, max_consecutive_skips=2, max_skipped_steps=50,
                    sdc_check_interval=0)
    settings.update(overrides)
    return FaultsConfig(**settings)


class _Stream:
    """The data stream as a rollback sees it: the next position and the skipped ranges."""

    def __init__(self, position: int) -> None:
        self.position = position
        self.skip_ranges: list[tuple[int, int]] = []

    def next_start(self, batch_size: int) -> int:
        return self.position

    def set_skip_ranges(self, ranges) -> None:
        self.skip_ranges = list(ranges)


def _parts(tmp_path: Path, *, position: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        run_dir=tmp_path, checkpoint_dir=tmp_path / "checkpoints", is_main=True,
        data=SimpleNamespace(train=_Stream(position)),
        batch_schedule=SimpleNamespace(batch_size_at=lambda step: 8),
    )


def _check(guard: FaultGuard, parts, step: int, loss: float, *, skipped: bool = False
           ) -> Decision:
    report = StepReport(step=step, total_steps=100, loss=torch.tensor(loss),
                        grad_norm=torch.tensor(1.0), skipped=skipped, lr=1e-3, tokens=0,
                        process_tokens=0, process_train_seconds=0.0, step_seconds=0.0)
    return guard.after_step(parts, SimpleNamespace(step=step), report)


def test_a_normal_step_continues(tmp_path) -> None:
    guard, parts = FaultGuard(_config()), _parts(tmp_path)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7, 4.65], start=1):
        assert _check(guard, parts, step, loss) == CONTINUE
    assert CONTINUE.kind is Act.CONTINUE and not CONTINUE.rolls_back
    assert read_history(tmp_path) == []


def test_a_spike_rolls_back_rollback_min_steps_before_it(tmp_path) -> None:
    guard, parts = FaultGuard(_config()), _parts(tmp_path)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7], start=1):
        assert _check(guard, parts, step, loss).kind is Act.CONTINUE
    decision = _check(guard, parts, 5, 9.0)
    # median 4.85, MAD 0.1 → deviation 1.4826 × 0.1; (9 − 4.85) / 0.14826 = 27.99
    assert decision.kind is Act.ROLL_BACK and decision.rolls_back
    assert (decision.spike_step, decision.at_most) == (5, 5 - 2)
    assert decision.reason == ("loss spike at step 5: 9.0000 against a median of 4.8500 "
                               "(28.0 robust deviations, threshold 6.0)")
    assert decision.spike is not None and decision.spike.step == 5
    assert decision.missing == (f"{decision.reason}; no complete checkpoint of step <= 3 in "
                                f"{tmp_path / 'checkpoints'} to roll back to "
                                "(faults.rollback_min_steps=2), so the run stops")
    assert decision.refused == "" and decision.error is None
    assert guard.record.rollbacks == [] and read_history(tmp_path) == []  # nothing done yet


def test_the_guard_records_what_the_loop_restored(tmp_path) -> None:
    guard, parts = FaultGuard(_config()), _parts(tmp_path, position=24)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7], start=1):
        _check(guard, parts, step, loss)
    decision = _check(guard, parts, 5, 9.0)
    guard.rolled_back(parts, decision, (3, tmp_path / "checkpoints" / "step-3"))
    # three batches of 8 sequences from the stream's position after step 3's checkpoint
    assert parts.data.train.skip_ranges == [(24, 48)]
    assert guard.record.skip_ranges == [(24, 48)]
    assert guard.record.rollbacks == [{"spike_step": 5, "to_step": 3}]
    assert [s for s, _ in guard.detector.history] == [1, 2, 3]
    (event,) = read_history(tmp_path)
    assert (event["event"], event["spike_step"], event["to_step"], event["skip"]) == (
        "rollback", 5, 3, [24, 48])
    assert event["loss"] == 9.0 and event["reason"] == decision.reason
    with pytest.raises(RunFaultError) as missing:
        guard.rolled_back(parts, decision, None)
    assert str(missing.value) == decision.missing


def test_a_spike_with_spike_action_stop_stops(tmp_path) -> None:
    guard, parts = FaultGuard(_config(spike_action="stop")), _parts(tmp_path)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7], start=1):
        _check(guard, parts, step, loss)
    decision = _check(guard, parts, 5, 9.0)
    assert decision.kind is Act.STOP and type(decision.error) is RunFaultError
    assert str(decision.error) == ("loss spike at step 5: 9.0000 against a median of 4.8500 "
                                   "(28.0 robust deviations, threshold 6.0); "
                                   "faults.spike_action='stop' ends the run")


def test_the_non_finite_cap_stops_or_rolls_back_from_the_first_skipped_step(tmp_path) -> None:
    guard, parts = FaultGuard(_config(nan_cap_action="stop")), _parts(tmp_path)
    assert _check(guard, parts, 1, float("nan"), skipped=True) == CONTINUE
    assert _check(guard, parts, 2, float("nan"), skipped=True) == CONTINUE
    decision = _check(guard, parts, 3, float("nan"), skipped=True)
    assert decision.kind is Act.STOP and type(decision.error) is RunFaultError
    assert str(decision.error) == (
        "3 non-finite steps in a row up to step 3 (faults.max_consecutive_skips=2); "
        "faults.nan_cap_action='stop' ends the run. Lower optim.lr or set optim.grad_clip")
    assert guard.record.skipped_steps == 3

    guard = FaultGuard(_config())
    assert _check(guard, parts, 7, 4.0) == CONTINUE
    for step in (8, 9):
        assert _check(guard, parts, step, float("nan"), skipped=True) == CONTINUE
    decision = _check(guard, parts, 10, float("nan"), skipped=True)
    assert decision.kind is Act.ROLL_BACK
    assert (decision.spike_step, decision.at_most) == (8, 8 - 2)  # first skipped: step 8
    assert guard.consecutive_skips == 0


def test_the_skipped_step_cap_stops(tmp_path) -> None:
    guard, parts = FaultGuard(_config(max_skipped_steps=1, max_consecutive_skips=5)), \
        _parts(tmp_path)
    assert _check(guard, parts, 1, float("nan"), skipped=True) == CONTINUE
    decision = _check(guard, parts, 2, float("nan"), skipped=True)
    assert decision.kind is Act.STOP
    assert str(decision.error) == (
        "step 2: 2 steps of the run had a non-finite loss or gradient norm, more than "
        "faults.max_skipped_steps=1; the run stops. Lower optim.lr or set optim.grad_clip")


def test_the_rollback_cap_stops_before_anything_is_loaded(tmp_path) -> None:
    record = FaultRecord()
    record.add_rollback(spike_step=2, to_step=1)
    guard, parts = FaultGuard(_config(max_rollbacks=1), record=record), _parts(tmp_path)
    for step, loss in enumerate([5.0, 4.9, 4.8, 4.7], start=1):
        _check(guard, parts, step, loss)
    decision = _check(guard, parts, 5, 9.0)
    assert decision.kind is Act.STOP
    assert str(decision.error).endswith(
        "; the run already rolled back 1 time(s) for spikes at steps [2] within "
        "faults.rollback_window_steps=1000 (faults.max_rollbacks=1), so it stops: lower "
        "optim.lr, raise schedule warmup or set optim.grad_clip")


def test_divergence_rolls_back_and_names_a_missing_checkpoint_first(tmp_path) -> None:
    config = _config(spike_detection=False, divergence_margin=1.0, spike_warmup_steps=5)
    guard, parts = FaultGuard(config), _parts(tmp_path)
    assert _check(guard, parts, 1, 5.0) == CONTINUE  # the initial loss
    assert _check(guard, parts, 2, 5.9) == CONTINUE  # 0.9 nats above: within the margin
    decision = _check(guard, parts, 3, 7.0)
    reason = ("training diverged at step 3: loss 7.0000, 2.00 nats above the initial loss "
              "5.0000 (faults.divergence_margin=1, checked until faults.spike_warmup_steps=5)")
    advice = "lower optim.lr or lengthen schedule.warmup_steps"
    assert decision.kind is Act.ROLL_BACK and (decision.spike_step, decision.at_most) == (3, 1)
    assert decision.reason == f"{reason}; {advice}"
    assert decision.missing == (f"{reason}; no complete checkpoint of step <= 1 in "
                                f"{tmp_path / 'checkpoints'} to roll back to, so the run "
                                f"stops: {advice}")
    assert decision.refused == ""
    early = _check(guard, parts, 2, float("inf"))
    assert early.at_most == 0 and early.missing.endswith(
        "; too early for a checkpoint faults.rollback_min_steps=2 steps before it, so the run "
        f"stops: {advice}")

    record = FaultRecord()
    record.add_rollback(spike_step=2, to_step=1)
    capped = FaultGuard(_replace(config, max_rollbacks=1), record=record)
    _check(capped, parts, 1, 5.0)
    decision = _check(capped, parts, 4, 7.0)  # past the cap: refused, still a rollback
    assert decision.kind is Act.ROLL_BACK and "already rolled back 1 time(s)" in decision.refused
    with pytest.raises(RunFaultError) as missing:  # no checkpoint: that message wins
        capped.rolled_back(parts, decision, None)
    assert str(missing.value) == decision.missing
    with pytest.raises(RunFaultError) as refused:
        capped.rolled_back(parts, decision, (2, tmp_path / "checkpoints" / "step-2"))
    assert str(refused.value) == decision.refused
    assert capped.record.rollbacks == [{"spike_step": 2, "to_step": 1}]


def test_a_replay_mismatch_is_handed_over_and_decided_once(tmp_path) -> None:
    guard, parts = FaultGuard(_config(spike_detection=False)), _parts(tmp_path)
    guard.note_replay("the replay disagrees")
    decision = _check(guard, parts, 4, 4.0)
    assert decision.kind is Act.STOP and type(decision.error) is SilentDataCorruptionError
    assert str(decision.error) == (
        "step 4: the replay disagrees; faults.sdc_action='stop' ends the run: restart it "
        "without the suspect ranks' hosts, from a checkpoint of step <= 3")
    assert read_history(tmp_path)[0]["event"] == "sdc"
    assert _check(guard, parts, 5, 4.0) == CONTINUE  # consumed

    guard = FaultGuard(_config(spike_detection=False, sdc_action="rollback"))
    guard.note_replay("the replay disagrees")
    decision = _check(guard, parts, 6, 4.0)
    assert decision.kind is Act.ROLL_BACK and (decision.spike_step, decision.at_most) == (6, 5)


class _Calls(Callback):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def flush(self) -> None:
        self.calls.append("flush")


class _Session:
    def __init__(self, calls: list, target) -> None:
        self.calls, self.target = calls, target

    def rollback(self, at_most: int):
        self.calls.append(("rollback", at_most))
        return self.target

    def newest_at_most(self, at_most: int):
        self.calls.append(("newest_at_most", at_most))
        return self.target


class _Guard:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def rolled_back(self, parts, decision, target) -> None:
        self.calls.append(("rolled_back", decision.at_most, target))


def test_the_loop_flushes_then_asks_the_session_then_tells_the_guard() -> None:
    calls: list = []
    target = (6, Path("step-6"))
    parts = SimpleNamespace(checkpoints=_Session(calls, target))
    loop = RunLoop(parts, SimpleNamespace(step=9), evaluator=None, callbacks=[_Calls(calls)],
                   guard=_Guard(calls))
    loop.roll_back(Decision(kind=Act.ROLL_BACK, at_most=7, spike_step=9, missing="none"))
    assert calls == ["flush", ("rollback", 7), ("rolled_back", 7, target)]
    calls.clear()
    loop.roll_back(Decision(kind=Act.ROLL_BACK, at_most=7, spike_step=9, refused="capped"))
    assert calls == ["flush", ("newest_at_most", 7), ("rolled_back", 7, target)]  # no load


def test_every_callback_has_every_hook() -> None:
    hooks = ("on_train_start", "on_step_end", "on_rollback", "on_preempt", "on_train_end",
             "flush", "close", "summary")
    base = Callback()
    for hook in hooks:
        assert callable(getattr(base, hook))
    assert base.on_preempt(None, None) is None


def _replace(config: FaultsConfig, **changes) -> FaultsConfig:
    from dataclasses import replace

    return replace(config, **changes)
