"""What a cycle may carry over from the last one: the running jobs that changed since.

Consecutive snapshots of a cluster share most of their running jobs, as the very same objects:
the simulator keeps them, and the live store hands back the model of a row that did not change
(activities/rows.py). Work that depends only on the running jobs (which GPUs they hold, when
they write checkpoints) can then be kept per cluster and brought up to date from the few jobs
that started or ended, instead of being done again for every job, every cycle. By identity,
never by equality: a changed job is a new object, so here it ends and starts again.
"""

from __future__ import annotations

import threading
from operator import is_
from typing import Callable, Generic, Sequence, TypeVar

from scheduler.models import RunningJob


class RunningChanges:
    """The running jobs as last seen, to tell which ended and which started since."""

    def __init__(self, running: Sequence[RunningJob]):
        # Holding the objects keeps their ids from being reused by new ones.
        self.jobs: dict[int, RunningJob] = dict(zip(map(id, running), running))
        self.last = tuple(running)

    def since(self, running: Sequence[RunningJob]) -> tuple[list[RunningJob], list[RunningJob]] | None:
        """(ended, started) since the last call, or None when most of the jobs changed: then
        starting again from every job costs no more."""
        last = self.last
        if len(last) == len(running) and all(map(is_, last, running)):
            return [], []  # the same jobs as the last call (in one cycle, several stages ask)
        self.last = tuple(running)
        now = dict(zip(map(id, running), running))
        gone = self.jobs.keys() - now.keys()
        new = now.keys() - self.jobs.keys()
        if 2 * (len(gone) + len(new)) > len(now):
            return None
        ended = [self.jobs[key] for key in gone]
        self.jobs = now
        return ended, [now[key] for key in new]


Kept = TypeVar("Kept")


class PerCluster(Generic[Kept]):
    """One kind of work kept from cycle to cycle, one per cluster (a process may plan several in
    turn). What it keeps changes in place: hold `lock` while getting it and reading it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._kept: dict[str, Kept] = {}

    def get(self, cluster: str, follows: Callable[[Kept], bool], make: Callable[[], Kept]) -> Kept:
        """The cluster's kept work if `follows` brings it up to date (it says False when it
        cannot), else a new one from `make`."""
        kept = self._kept.get(cluster)
        if kept is None or not follows(kept):
            if len(self._kept) > 64:
                self._kept.clear()
            kept = self._kept[cluster] = make()
        return kept


class PerJob(Generic[Kept]):
    """Work that depends only on one running job and on what it is read against (the fleet's
    layout, a setting), kept while the job object lives: a running job is immutable and lasts
    many cycles, and most cycles ask the same of each. Found and checked by identity, so a
    changed job (a new object) or a new layout is worked out afresh."""

    def __init__(self, work: Callable[[RunningJob, object], Kept], most: int = 100_000):
        self._work = work
        self._most = most  # jobs long gone are dropped all at once past this many
        self._kept: dict[int, tuple[RunningJob, object, Kept]] = {}

    def get(self, job: RunningJob, against: object) -> Kept:
        found = self._kept.get(id(job))
        if found is not None and found[0] is job and found[1] is against:
            return found[2]
        if len(self._kept) > self._most:
            self._kept.clear()
        kept = self._work(job, against)
        self._kept[id(job)] = (job, against, kept)
        return kept
