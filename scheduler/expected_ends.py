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
from scheduler.models import RunningJob
from scheduler.since_last_cycle import PerCluster, RunningChanges

Ends = list[tuple[RunningJob, float, list[tuple[int, int]]]]


def expected_ends(layout: Layout, running: Sequence[RunningJob], now: float, restart: float) -> Ends:
    """(job, expected end, (machine, GPU count) of the GPUs it gives back) per running job, in
    order. `restart`: PolicyConfig.expected_restart_s."""
    if not isinstance(running, (list, tuple)):
        running = tuple(running)
    with _kept.lock:
        plans = _kept.get(layout.cluster, lambda kept: kept.update(layout, restart, running),
                          lambda: _Plans(layout, restart, running)).by_job
        planned = list(map(plans.__getitem__, map(id, running)))
    return [(job, end if end > now else job.expected_end(now), machines) for job, end, machines in planned]


def plain_end(job: RunningJob, restart: float) -> float:
    """When the job ends by its user's estimate (and, if it resumed, the restart it was expected
    to need), or -inf for a draining job (its end is the end of its grace):
    `RunningJob.expected_end` gives either whenever it is later than now."""
    if job.draining:
        return -math.inf
    return job.estimated_end + restart if restart and job.resumed else job.estimated_end


class _Plans:
    """Per running job (by identity): the job, its plain end and the machines it frees."""

    def __init__(self, layout: Layout, restart: float, running: Sequence[RunningJob]):
        self.layout, self.restart = layout, restart
        self.changes = RunningChanges(running)
        self.by_job: dict[int, tuple[RunningJob, float, list[tuple[int, int]]]] = {}
        for job in running:
            self._add(job)

    def _add(self, job: RunningJob) -> None:
        self.by_job[id(job)] = (job, plain_end(job, self.restart), grouped(self.layout, job).counts)

    def update(self, layout: Layout, restart: float, running: Sequence[RunningJob]) -> bool:
        """Follow the jobs that started and ended since; False when the layout or the restart
        changed, or most jobs did (build anew)."""
        if layout is not self.layout or restart != self.restart:
            return False
        changes = self.changes.since(running)
        if changes is None:
            return False
        ended, started = changes
        for job in ended:
            del self.by_job[id(job)]
        for job in started:
            self._add(job)
        return True


_kept: PerCluster[_Plans] = PerCluster()
