"""LR schedules equal their formulas (checked against transformers' schedules) and the GPT-3
batch-size ramp equals a step-by-step simulation of Brown et al. 2020, App. B."""

import math

import pytest
import torch
from transformers.optimization import (
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from densetrain.optim import BatchSizeSchedule, ScheduleConfig, build_lr_scheduler, lr_at

PEAK = 2.0


def _hf_multipliers(make_scheduler, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = make_scheduler(optimizer)
    values = []
    for _ in range(steps + 1):
        values.append(optimizer.param_groups[0]["lr"] / PEAK)
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize("warmup, total, floor", [(10, 100, 0.1), (0, 37, 0.0), (5, 6, 0.25)])
def test_cosine_matches_reference_and_formula(warmup, total, floor):
    cfg = ScheduleConfig(name="cosine", warmup_steps=warmup, min_lr_ratio=floor)
    reference = _hf_multipliers(
        lambda opt: get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=floor), total)
    for step in range(total + 1):
        ours = lr_at(step, cfg, total)
        if step < warmup:  # ours reaches the peak on the last warmup step: (s + 1) / W
            assert ours == pytest.approx((step + 1) / warmup)
        else:
            assert ours == pytest.approx(reference[step], abs=1e-12)
    assert lr_at(total, cfg, total) == pytest.approx(floor)  # the cycle is the run length
    assert lr_at(10 * total, cfg, total) == pytest.approx(floor)


def test_chinchilla_cosine_ends_at_ten_percent():
    cfg = ScheduleConfig(name="cosine", warmup_steps=100)
    mid = 100 + (1000 - 100) // 2
    assert lr_at(mid, cfg, 1000) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(1000, cfg, 1000) == pytest.approx(0.1)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt", "cosine"])
def test_wsd_matches_reference(shape):
    warmup, total, fraction, floor = 8, 120, 0.25, 0.05
    cfg = ScheduleConfig(name="wsd", warmup_steps=warmup, decay_fraction=fraction,
                         decay_shape=shape, min_lr_ratio=floor)
    decay = round(fraction * total)
    reference = _hf_multipliers(
        lambda opt: get_wsd_schedule(
            opt, num_warmup_steps=warmup, num_decay_steps=decay,
            num_stable_steps=total - warmup - decay, decay_type=shape, min_lr_ratio=floor),
        total)
    for step in range(warmup, total + 1):
        assert lr_at(step, cfg, total) == pytest.approx(reference[step], abs=1e-12)
    assert lr_at(total - decay - 1, cfg, total) == 1.0


def test_linear_matches_reference_and_constant_is_flat():
    cfg = ScheduleConfig(name="linear", warmup_steps=4, min_lr_ratio=0.0)
    reference = _hf_multipliers(lambda opt: get_linear_schedule_with_warmup(opt, 4, 50), 50)
    for step in range(4, 51):
        assert lr_at(step, cfg, 50) == pytest.approx(reference[step], abs=1e-12)
    constant = ScheduleConfig(name="constant", warmup_steps=4)
    assert [lr_at(s, constant, 50) for s in (0, 3, 4, 49)] == [0.25, 1.0, 1.0, 1.0]


def test_rsqrt_is_palm_schedule():
    cfg = ScheduleConfig(name="rsqrt", warmup_steps=10_000)
    assert lr_at(0, cfg, 10**6) == 1.0 and lr_at(10_000, cfg, 10**6) == 1.0
    assert lr_at(40_000, cfg, 10**6) == pytest.approx(0.5)  # 1e-2 · √(10⁴/4·10⁴)


def test_scheduler_drives_optimizer_and_resumes_exactly():
    cfg = ScheduleConfig(name="cosine", warmup_steps=3, min_lr_ratio=0.1)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]

    def make():
        opt = torch.optim.SGD([{"params": [params[0]], "lr": 1.0},
                               {"params": [params[1]], "lr": 0.5}], lr=1.0)
        return opt, build_lr_scheduler(opt, cfg, 20)

    opt, scheduler = make()
    seen = []
    for step in range(20):
        seen.append([g["lr"] for g in opt.param_groups])
        assert seen[-1] == pytest.approx([lr_at(step, cfg, 20), 0.5 * lr_at(step, cfg, 20)])
        opt.step()
        scheduler.step()
        if step == 9:
            saved = scheduler.state_dict()
    assert saved == {"step": 10}
    opt2, scheduler2 = make()
    scheduler2.load_state_dict(saved)
    for step in range(10, 20):
        assert [g["lr"] for g in opt2.param_groups] == pytest.approx(seen[step])
        opt2.step()
        scheduler2.step()


def test_unresolved_warmup_tokens_are_rejected():
    with pytest.raises(ValueError, match="warmup_tokens"):
        lr_at(0, ScheduleConfig(warmup_tokens=1000), 10)


def _simulate_ramp(full, start, increment, ramp_tokens, seq_len, steps):
    """Brown et al. 2020 App. B, step by step: the batch grows linearly in tokens consumed."""
    increments = (full - start) // increment
    tokens_per_increment = ramp_tokens / increments
    consumed, batches = 0, []
    for _ in range(steps):
        batch = min(full, start + int(consumed / tokens_per_increment) * increment)
        batches.append(batch)
        consumed += batch * seq_len
    return batches


@pytest.mark.parametrize("full, start, increment, ramp_tokens, seq_len", [
    (512, 32, 32, 4_000_000, 1024),
    (1536, 16, 16, 1_000_000, 64),
    (96, 8, 8, 777_777, 70),
    (2048, 1024, 1024, 10**7, 8192),
])
def test_batch_ramp_matches_simulation(full, start, increment, ramp_tokens, seq_len):
    schedule = BatchSizeSchedule(global_batch_size=full, seq_len=seq_len, ramp_start=start,
                                 ramp_tokens=ramp_tokens, ramp_increment=increment)
    reference = _simulate_ramp(full, start, increment, ramp_tokens, seq_len, 3000)
    ours = [schedule.batch_size_at(step) for step in range(3000)]
    assert ours == reference
    assert all(b % increment == 0 for b in ours)
    assert ours[0] == start and ours[-1] == full
    consumed = 0
    for step in range(3000):
        assert schedule.tokens_before(step) == consumed
        assert schedule.steps_for_tokens(consumed) == step
        consumed += ours[step] * seq_len
    first_full = ours.index(full)
    assert schedule.tokens_before(first_full) >= ramp_tokens
    assert schedule.tokens_before(first_full - 1) < ramp_tokens


def test_constant_batch_and_ramp_state():
    constant = BatchSizeSchedule(global_batch_size=16, seq_len=256)
    assert constant.batch_size_at(0) == constant.batch_size_at(10**6) == 16
    assert constant.steps_for_tokens(4096 * 3 + 1) == 4
    ramp = BatchSizeSchedule(global_batch_size=64, seq_len=8, ramp_start=16, ramp_tokens=1000,
                             ramp_increment=16)
    ramp.load_state_dict(ramp.state_dict())
    other = BatchSizeSchedule(global_batch_size=64, seq_len=8, ramp_start=32, ramp_tokens=1000,
                              ramp_increment=16)
    with pytest.raises(ValueError, match="ramp"):
        ramp.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="divisible"):
        BatchSizeSchedule(global_batch_size=60, seq_len=8, ramp_start=16, ramp_tokens=10,
                          ramp_increment=16)
    assert math.isclose(
        BatchSizeSchedule(global_batch_size=64, seq_len=8).tokens_before(3), 3 * 64 * 8)
