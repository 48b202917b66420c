"""Checkpoint staggering: give each job a phase so storage sees a stream, not a burst.

Jobs started by the same cycle would otherwise all checkpoint at start + k × interval, together.
A job with interval I checkpoints at the times t ≡ phase (mod I). The phase is chosen, in whole
slots, where the write load already planned (GPU count as a proxy for checkpoint size) is
lowest over one common period.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from scheduler.models import RunningJob
from scheduler.since_last_cycle import PerCluster, RunningChanges


def _bins(period: float, slot: float) -> int:
    return max(1, math.ceil(period / slot))


class WritePlan:
    def __init__(self, slot: float, period: float):
        self.slot = slot
        self.bins = _bins(period, slot)
        self.period = self.bins * slot
        self.load = [0.0] * self.bins

    def _times(self, interval: float, phase: float) -> list[int]:
        """The bins a job of this interval and phase writes in over one period."""
        period, slot = self.period, self.slot
        return [int(((phase + k * interval) % period) // slot) for k in range(max(1, round(period / interval)))]

    def add(self, interval: float, phase: float, weight: float) -> None:
        # _times written out: a cycle that places a job adds every running job to the plan.
        load, period, slot = self.load, self.period, self.slot
        for k in range(max(1, round(period / interval))):
            load[int(((phase + k * interval) % period) // slot)] += weight

    def choose(self, interval: float, weight: float) -> float:
        """The least loaded phase for a new job, lowest on ties; recorded in the plan."""
        # Phases a period apart write in the same bins: a job that saves less often than once a
        # period has only the period's phases to choose from.
        candidates = max(1, int(min(interval, self.period) // self.slot))
        best_phase, best_cost = 0.0, math.inf
        for c in range(candidates):
            phase = c * self.slot
            cost = max(self.load[b] for b in self._times(interval, phase))
            if cost < best_cost:
                best_phase, best_cost = phase, cost
        self.add(interval, best_phase, weight)
        return best_phase


LONGEST_PERIOD = 86400.0  # a day of slots: a job saving once a month must not make a cycle plan a month


def plan_period(intervals: Iterable[float]) -> float:
    """One common period: the longest interval, at least an hour and at most a day."""
    return min(LONGEST_PERIOD, max([3600.0, *intervals]))


def _writes(job: RunningJob) -> tuple[float, float, int] | None:
    """(interval, phase, GPUs) of a running job that checkpoints; None for one that never does."""
    interval = job.spec.checkpoint_interval
    if not interval:
        return None
    phase = job.checkpoint_phase if job.checkpoint_phase is not None else job.started_at
    return interval, phase, job.spec.num_gpus


class _RunningLoad:
    """The running jobs' write load, kept from one cycle to the next (scheduler/since_last_cycle.py):
    a cycle that places jobs adds to it only the jobs that started since the last one, and takes
    out those that ended. Loads are GPU counts, whole numbers, so the sums are exact in any order."""

    def __init__(self, running: Sequence[RunningJob], slot: float):
        self.changes = RunningChanges(running)
        self.slot = slot
        self.intervals: dict[float, int] = {}  # of the jobs that checkpoint: how many have each
        for job in running:
            self._count(job, 1)
        self.plan: WritePlan | None = None  # for the period it was made with

    def _count(self, job: RunningJob, sign: int) -> tuple[float, float, int] | None:
        writes = _writes(job)
        if writes is not None:
            left = self.intervals.get(writes[0], 0) + sign
            if left:
                self.intervals[writes[0]] = left
            else:
                del self.intervals[writes[0]]
        return writes

    def update(self, running: Sequence[RunningJob]) -> bool:
        changes = self.changes.since(running)
        if changes is None:
            return False
        ended, started = changes
        plan = self.plan
        for job, sign in [(j, -1) for j in ended] + [(j, 1) for j in started]:
            writes = self._count(job, sign)
            if writes is not None and plan is not None:
                interval, phase, gpus = writes
                plan.add(interval, phase, sign * gpus)
        return True

    def plan_for(self, running: Sequence[RunningJob], placing: Iterable[float]) -> WritePlan:
        """A plan holding the running jobs' load over the period that also fits `placing`."""
        period = plan_period([*self.intervals, *placing])
        plan = self.plan
        if plan is None or plan.bins != _bins(period, self.slot):
            plan = self.plan = WritePlan(self.slot, period)
            for job in running:
                writes = _writes(job)
                if writes is not None:
                    plan.add(*writes)
        twin = WritePlan(plan.slot, plan.period)
        twin.load = list(plan.load)
        return twin


_carried: PerCluster[_RunningLoad] = PerCluster()


def running_plan(cluster: str, running: Sequence[RunningJob], slot: float, placing: Iterable[float]) -> WritePlan:
    """A write plan for one cycle's new jobs, loaded with every running job that checkpoints, over
    one period for the running jobs' intervals and `placing` (those of the jobs being placed)."""
    with _carried.lock:
        carried = _carried.get(cluster, lambda kept: kept.slot == slot and kept.update(running),
                               lambda: _RunningLoad(running, slot))
        return carried.plan_for(running, placing)
