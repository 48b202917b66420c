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
from collections import deque
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
        starting again from every job costs no more. The lists may be shared with other callers
        that followed the same jobs: read them, do not change them."""
        last = self.last
        if len(last) == len(running) and all(map(is_, last, running)):
            return [], []  # the same jobs as the last call (in one cycle, several stages ask)
        with _recent_lock:
            recent = tuple(_recent)
        seen = None
        for before, after, jobs, ended, started in recent:
            if len(after) == len(running) and all(map(is_, after, running)):
                if before is last:
                    # Another follower went from the same jobs to these already: its answer is ours.
                    self.last, self.jobs = after, jobs
                    return ended, started
                seen = after, jobs  # these jobs, from other jobs than ours: only their record is ours
                break
        now_seen, now = seen if seen is not None else (tuple(running), dict(zip(map(id, running), running)))
        self.last = now_seen
        gone = self.jobs.keys() - now.keys()
        new = now.keys() - self.jobs.keys()
        if 2 * (len(gone) + len(new)) > len(now):
            return None
        ended = [self.jobs[key] for key in gone]
        started = [now[key] for key in new]
        with _recent_lock:
            _recent.append((last, now_seen, now, ended, started))
        self.jobs = now
        return ended, started


# The last changes worked out, for the other followers of the same jobs: in one cycle several
# stages (capacity, quotas, expected ends, staggering) each follow the running jobs from the
# last cycle, and the first to ask works out the changes for all of them. Nothing in an entry
# is changed after it is made: a follower adopts its jobs as its own last seen.
_recent: deque[tuple[tuple, tuple, dict[int, RunningJob], list[RunningJob], list[RunningJob]]] = deque(maxlen=4)
_recent_lock = threading.Lock()


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


class PerRunningJob:
    """`(job, *work(job))` per running job, by identity, for the jobs running: made for them once,
    then brought up to date from the jobs that started and ended since (`follow`)."""

    def __init__(self, work: Callable[[RunningJob], tuple], running: Sequence[RunningJob]):
        self._work = work
        self._changes = RunningChanges(running)
        self.by_job: dict[int, tuple] = {}
        self._apply([], running)

    def follow(self, running: Sequence[RunningJob]) -> bool:
        """Up to date with `running`; False when most jobs changed (make a new one)."""
        changes = self._changes.since(running)
        if changes is None:
            return False
        ended, started = changes
        if ended or started:
            self._apply(ended, started)
        return True

    def _apply(self, ended: Sequence[RunningJob], started: Sequence[RunningJob]) -> None:
        # A new dict: a cycle still reading the last one (another thread) keeps it as it was.
        by_job = dict(self.by_job)
        for job in ended:
            del by_job[id(job)]
        for job in started:
            by_job[id(job)] = (job, *self._work(job))
        self.by_job = by_job


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
