"""When each running job is expected to give its GPUs back, and where: the calendar that the
check for GPUs freeing up soon, reservations and the estimate all read.

A running job's end by its user's estimate depends on the job alone (and on the restart a
resumed job is allowed), and the machines it frees on the layout: neither changes while the job
runs. They are kept per cluster from one cycle to the next (scheduler/since_last_cycle.py) and
worked out only for the jobs that started since; each cycle then only sets the ends already
past at a little after now.
"""

from __future__ import annotations

import math
from typing import Sequence

from scheduler.capacity import Layout, grouped
from scheduler.models import GpuSlot, RunningJob
from scheduler.since_last_cycle import PerCluster, PerRunningJob

# Per running job: (expected end, job, its GPUs, (machine, GPU count) of them, its GPU count). In
# the order of coming_back.Return, whose usual return of a running job's GPUs is this very tuple.
End = tuple[float, RunningJob, tuple[GpuSlot, ...], list[tuple[int, int]], int]
Ends = list[End]


def expected_ends(layout: Layout, running: Sequence[RunningJob], now: float, restart: float) -> Ends:
    """Per running job, in order: when it is expected to give its GPUs back, the job, its GPUs,
    (machine, GPU count) of them and how many. `restart`: PolicyConfig.expected_restart_s. A
    job's entry is the same tuple from cycle to cycle while its end is ahead."""
    if not isinstance(running, (list, tuple)):
        running = tuple(running)
    with _kept.lock:
        plans = _kept.get(layout.cluster, lambda kept: kept.update(layout, restart, running),
                          lambda: _Plans(layout, restart, running)).by_job
        planned = list(map(plans.__getitem__, map(id, running)))
    return [entry if entry[0] > now else (job.expected_end(now), *entry[1:]) for job, entry in planned]


def end_of(job: RunningJob, now: float, restart: float) -> float:
    """One running job's expected end, as `expected_ends` gives it (without the per-cycle store)."""
    end = plain_end(job, restart)
    return end if end > now else job.expected_end(now)


def plain_end(job: RunningJob, restart: float) -> float:
    """When the job ends by its user's estimate (and, if it resumed, the restart it was expected
    to need), or -inf for a draining job (its end is the end of its grace):
    `RunningJob.expected_end` gives either whenever it is later than now."""
    if job.draining:
        return -math.inf
    return job.estimated_end + restart if restart and job.resumed else job.estimated_end


class _Plans(PerRunningJob):
    """Per running job (by identity): the job, and its entry of `expected_ends` with its plain end."""

    def __init__(self, layout: Layout, restart: float, running: Sequence[RunningJob]):
        self.layout, self.restart = layout, restart
        super().__init__(lambda job: ((plain_end(job, restart), job, job.gpus, grouped(layout, job).counts,
                                       job.spec.num_gpus),), running)

    def update(self, layout: Layout, restart: float, running: Sequence[RunningJob]) -> bool:
        """False when the layout or the restart changed, or most jobs did (build anew)."""
        return layout is self.layout and restart == self.restart and self.follow(running)


_kept: PerCluster[_Plans] = PerCluster()
