"""``checkpoint.interval = "auto"``: the checkpoint interval of Young and Daly, as pure functions.

A save stalls training for δ seconds; a failure loses the work since the last save and strikes
on average every M seconds (the mean time between failures, MTBF). Young (1974, "A first order
approximation to the optimum checkpoint interval", CACM 17(9)) minimises the expected time lost
to both and finds the compute time between saves

    τ = √(2 · δ · M)

Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3)) derives the same expression as the first-order term of the exact optimum; his
higher-order corrections matter only when δ is not small against M (δ/M of a save stall of
seconds against an MTBF of hours is ~1e-3), so the first-order form is used here.

M is estimated from the run's history (`failure_history`): every process of an ``auto`` run
records ``process_start`` in ``<run_dir>/run_history.jsonl`` and, when it finishes or is
preempted (both save first, so they lose no work), ``process_end``; a start with no end before
the next start is a failure. The estimate (`mtbf_hours`) combines a prior with the history:
a Gamma prior on the failure rate worth one failure in ``prior`` hours gives, after ``n``
failures in ``T`` hours of exposure, the rate (1 + n) / (prior + T), so

    M = (prior + T) / (1 + n)

which is the prior before anything is seen and tends to T / n as failures accumulate.

The prior is a per-device MTBF divided by the number of ranks (failures of independent devices
add up). The default per-device figure is Llama 3's (Dubey et al., 2024, §3.3.4): 466
interruptions in 54 days on 16,384 GPUs, i.e. 54 · 24 · 16384 / 466 ≈ 45,566 device-hours per
interruption (2.8 hours for the whole 16k-GPU job).
"""

from __future__ import annotations

import calendar
import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LLAMA3_INTERRUPTIONS = 466
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_DEVICE_MTBF_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS
"""≈ 45,566 hours: the default ``checkpoint.mtbf_prior_device_hours``."""

PROCESS_START = "process_start"
PROCESS_END = "process_end"
CLEAN_ENDS = ("finished", "preempted")
"""``process_end`` outcomes that are no failure: both save the state before the process ends."""


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between saves, √(2 · δ · M), in seconds."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def prior_mtbf_hours(device_hours: float, world_size: int) -> float:
    """The job's prior MTBF: the per-device MTBF over the number of ranks (independent devices'
    failure rates add)."""
    return device_hours / max(world_size, 1)


def mtbf_hours(prior_hours: float, failures: int, exposure_hours: float) -> float:
    """(prior + T) / (1 + n): the prior, worth one failure, updated with ``failures`` seen in
    ``exposure_hours`` of the run's life."""
    return (prior_hours + exposure_hours) / (1 + failures)


def interval_steps(tau_s: float, step_s: float, minimum: int) -> int:
    """τ in steps of ``step_s`` seconds (nearest), at least ``minimum``."""
    if not (step_s > 0 and math.isfinite(tau_s)):
        return minimum
    return max(minimum, round(tau_s / step_s))


def _event_time(event: dict[str, Any]) -> float | None:
    """The UTC time of a history line (`resume.append_history` writes ISO seconds)."""
    try:
        return float(calendar.timegm(time.strptime(event["time"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError, ValueError):
        return None


def failure_history(events: Iterable[dict[str, Any]], now: float) -> tuple[int, float]:
    """(failures, exposure hours) from history events in file order, up to ``now`` (UTC s).

    A ``process_start`` while the previous process never wrote ``process_end`` is a failure of
    that process (killed, crashed, lost its node); so is a ``process_end`` with an outcome other
    than `CLEAN_ENDS`. Exposure is the time processes were up; a failed process is taken to be up
    until the next start (its time of death is not recorded), which counts restart delays as
    exposure and so errs towards a longer M. Other events are ignored."""
    failures, exposure, open_since = 0, 0.0, None
    for event in events:
        kind, at = event.get("event"), _event_time(event)
        if kind not in (PROCESS_START, PROCESS_END) or at is None:
            continue
        if open_since is not None:
            exposure += max(at - open_since, 0.0)
        if kind == PROCESS_START:
            failures += open_since is not None
            open_since = at
        else:
            failures += event.get("outcome") not in CLEAN_ENDS and open_since is not None
            open_since = None
    if open_since is not None:
        exposure += max(now - open_since, 0.0)
    return failures, exposure / 3600.0


def read_history_events(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``run_history.jsonl``; a line that is not one (a line torn by a
    kill) is skipped: the file is the run's record, and an estimate must not stop the run."""
    path = Path(path)
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def last_measured(events: Iterable[dict[str, Any]]) -> tuple[float, float] | None:
    """(save stall s, step s) of the newest interval decided from measurements, when the
    process that measured them ran at the world size of the newest ``process_start`` (the
    process asking): a restarted process starts at the interval its predecessor had reached
    instead of ``auto_initial_interval``. None when there is none or the world size changed."""
    found, world, measured_world = None, None, None
    for event in events:
        kind = event.get("event")
        if kind == PROCESS_START:
            world = event.get("world_size")
        elif kind == "checkpoint_interval":
            stall, step = event.get("stall_s"), event.get("step_s")
            if isinstance(stall, (int, float)) and isinstance(step, (int, float)) and (
                    stall >= 0 and step > 0 and math.isfinite(stall) and math.isfinite(step)):
                found, measured_world = (float(stall), float(step)), world
    if found is None or measured_world is None or measured_world != world:
        return None
    return found


@dataclass(frozen=True, kw_only=True)
class IntervalDecision:
    """One choice of the interval and what it was computed from (None: not measured yet)."""

    steps: int
    stall_s: float | None
    step_s: float | None
    tau_s: float | None
    mtbf_hours: float
    prior_hours: float
    failures: int
    exposure_hours: float
    carried: bool = False
    """δ and the step time are those the previous process measured (`last_measured`)."""

    def record(self) -> dict[str, Any]:
        """The fields as one JSON-ready dict (the ``checkpoint_interval`` history event)."""
        return asdict(self)

    def describe(self) -> str:
        """One line: the interval and why."""
        mtbf = (f"M = {self.mtbf_hours:.4g} h MTBF (prior {self.prior_hours:.4g} h, "
                f"{self.failures} failures in {self.exposure_hours:.3g} h of run history)")
        if self.tau_s is None:
            return (f"checkpoint.interval=auto: saving every {self.steps} steps "
                    f"(checkpoint.auto_initial_interval) until a save stall is measured; {mtbf}")
        return (f"checkpoint.interval=auto: saving every {self.steps} steps: "
                f"τ = √(2·δ·M) = {self.tau_s:.4g} s with δ = {self.stall_s:.4g} s save stall, "
                f"{mtbf}, at {self.step_s:.4g} s/step"
                f"{' (δ and step time as measured before the restart)' if self.carried else ''}"
                " (Young 1974, Daly 2006)")


def decide(*, stall_s: float | None, step_s: float | None, prior_hours: float, failures: int,
           exposure_hours: float, initial: int, minimum: int,
           carried: bool = False) -> IntervalDecision:
    """The interval for a measured save stall and step time (``initial`` steps while either is
    None), at least ``minimum`` steps; ``carried``: they come from the previous process."""
    mtbf = mtbf_hours(prior_hours, failures, exposure_hours)
    if stall_s is None or step_s is None:
        return IntervalDecision(steps=initial, stall_s=None, step_s=None, tau_s=None,
                                mtbf_hours=mtbf, prior_hours=prior_hours, failures=failures,
                                exposure_hours=exposure_hours)
    tau = young_interval_s(stall_s, mtbf * 3600.0)
    return IntervalDecision(steps=interval_steps(tau, step_s, minimum), stall_s=stall_s,
                            step_s=step_s, tau_s=tau, mtbf_hours=mtbf, prior_hours=prior_hours,
                            failures=failures, exposure_hours=exposure_hours, carried=carried)
