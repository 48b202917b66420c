"""Checkpoint staggering: give each job a phase so storage sees a stream, not a burst.

Jobs started by the same cycle would otherwise all checkpoint at start + k × interval, together.
A job with interval I checkpoints at the times t ≡ phase (mod I). The phase is chosen, in whole
slots, where the write load already planned (GPU count as a proxy for checkpoint size) is
lowest over one common period.
"""

from __future__ import annotations

import math
from typing import Iterable


class WritePlan:
    def __init__(self, slot: float, period: float):
        self.slot = slot
        self.bins = max(1, math.ceil(period / slot))
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
        candidates = max(1, int(interval // self.slot))
        best_phase, best_cost = 0.0, math.inf
        for c in range(candidates):
            phase = c * self.slot
            cost = max(self.load[b] for b in self._times(interval, phase))
            if cost < best_cost:
                best_phase, best_cost = phase, cost
        self.add(interval, best_phase, weight)
        return best_phase


def plan_period(intervals: Iterable[float]) -> float:
    """One common period: the longest interval, at least an hour."""
    return max([3600.0, *intervals])
