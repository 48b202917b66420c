"""What the estimate's walk cannot see on its own: work that arrives later.

A queued job's estimated start comes from walking the queue forward (scheduler/eta.py). In a busy
cluster, that walk alone is too hopeful: more important work submitted after now takes the GPUs
the job was counting on. So the walk is told what is likely to arrive.

The forecast
  1. Work comes in daily rhythms, so the best cheap guess for the next day is the last one: every
     submission of the last `forecast_window` seconds is expected again one window later, with
     its class, GPU count and expected duration (`expected_arrivals`).
  2. An arrival due t seconds from now counts for min(1, t / `forecast_ramp`) of its GPUs.
     Near-term arrivals mostly start by preempting running low-class work, and the gangs they
     displace leave GPUs over for the head of the queue: they do not take the releases a waiting
     job counts on. The further ahead, the more of that preemptible work is used up or protected,
     and arrivals wait for releases like everyone else (docs/eta.md has the measurements
     behind the default).

How it delays an estimate (`ArrivalLoad`, used by the walk)
  3. While they run, expected arrivals of a more important class hold GPUs (their counted
     share): a fluid load over time, without placement. A job the walk starts at t, after the
     walk has seen `x` GPUs come back since now, really starts once the GPUs come back since
     now, less those the more important arrivals then hold, reach `x` again: the arrivals are
     served first.
  4. A job that its team's guarantee covers is not delayed: guarantees are reclaimed, whatever
     the class of the borrower holding them. Nor is a critical job: nothing goes before it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Iterable

from scheduler.models import ExpectedArrival, PolicyConfig, Priority

_CLASSES = len(Priority)
_RANK = {p: p.rank for p in Priority}
_GRID = 2.0 ** 20  # fractions of a GPU counted in part are multiples of 1 / _GRID


class SubmissionLog:
    """Past submissions, in time order, from which the forecast is made."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.kinds: list[tuple[Priority, int, float]] = []  # (class, GPUs, expected duration)
        # The forecast's arrivals as made so far, for one window (cycles ask for overlapping spans)
        self.made: list[ExpectedArrival] = []
        self.made_for = 0.0

    def add(self, submit_time: float, priority: Priority, num_gpus: int, expected_duration: float) -> None:
        if self.times and submit_time < self.times[-1]:
            raise ValueError("submissions must be added in time order")
        self.times.append(submit_time)
        self.kinds.append((Priority(priority), num_gpus, expected_duration))

    def expected_arrivals(self, now: float, config: PolicyConfig) -> tuple[ExpectedArrival, ...]:
        """The last window's submissions, each expected again one window after it was made."""
        window = config.forecast_window
        if window <= 0:
            return ()
        if window != self.made_for:
            self.made, self.made_for = [], window
        done = len(self.made)
        for submit, (priority, gpus, duration) in zip(self.times[done:], self.kinds[done:]):
            self.made.append(ExpectedArrival.model_construct(
                at=submit + window, priority=priority, num_gpus=gpus, expected_duration=duration))
        first = bisect_right(self.times, now - window)
        last = bisect_right(self.times, now)
        return tuple(self.made[first:last])


def expected_arrivals(submissions: Iterable[tuple[float, Priority, int, float]], now: float,
                      config: PolicyConfig) -> tuple[ExpectedArrival, ...]:
    """The forecast from (submit time, class, GPUs, expected duration) in any order: the live
    loop's recent jobs."""
    log = SubmissionLog()
    for submission in sorted(submissions, key=lambda row: row[0]):
        log.add(*submission)
    return log.expected_arrivals(now, config)


class ArrivalLoad:
    """The GPUs expected arrivals hold over time, by class, read as the walk moves forward.

    `started` tells it of a job the walk starts, and answers whether it really starts then;
    `released` tells it of GPUs the walk gives back, and answers with the jobs whose turn has
    come since (job id, start). The walk does not count the GPUs of a job that waits here as
    given back when it ends in the walk: that job ends its expected duration after its real
    start, and this counts them then."""

    def __init__(self, arrivals: Iterable[ExpectedArrival], now: float, ramp: float):
        events = []  # (time, class rank, GPUs held from then on)
        last, full = _CLASSES - 1, now + ramp
        for a in arrivals:
            at, rank = a.at, _RANK[a.priority]
            if at <= now or rank == last:
                continue  # counts for nothing, or of the last class: goes before nobody
            # In part: on a grid of 2**-20 GPU, which floats add and take off again exactly (no
            # residue holds a job back once every arrival has ended).
            gpus = a.num_gpus if at >= full else round(a.num_gpus * (at - now) / ramp * _GRID) / _GRID
            events.append((at, rank, gpus))
            events.append((at + a.expected_duration, rank, -gpus))
        events.sort()
        self.events = events
        self.next = 0
        self.ahead = [0.0] * _CLASSES  # GPUs held by arrivals more important than each class rank
        self.returned = 0  # GPUs the walk has given back since now
        # Jobs waiting for the arrivals ahead of them, by class: (GPUs given back when the walk
        # started them, seq, job id, its GPUs, its duration); each starts once as many have come
        # back beyond what the arrivals ahead of it hold.
        self.waiting: list[list[tuple[int, int, str, int, float]]] = [[] for _ in range(_CLASSES)]
        self.count = 0  # jobs waiting
        self.due: list[tuple[str, float]] = []
        self.ends: list[tuple[float, int]] = []  # (when, GPUs): the waiting jobs' real ends
        self.seq = 0

    def __bool__(self) -> bool:
        return bool(self.events)

    @property
    def delaying(self) -> bool:
        return self.count > 0

    def started(self, job_id: str, rank: int, t: float, gpus: int, duration: float) -> bool:
        if self.next < len(self.events) and self.events[self.next][0] <= t or self.ends:
            self._advance(t)
        if self.ahead[rank] <= 0:
            return True
        heapq.heappush(self.waiting[rank], (self.returned, self.seq, job_id, gpus, duration))
        self.seq += 1
        self.count += 1
        return False

    def released(self, gpus: int, t: float) -> list[tuple[str, float]]:
        self._advance(t)
        self.returned += gpus
        self._check(t)
        return self._take()

    def drain(self, end: float) -> list[tuple[str, float]]:
        """After the walk's last release: the arrivals' own ends, up to `end`, let the rest start."""
        while self.delaying:
            soonest = min(self.events[self.next][0] if self.next < len(self.events) else end + 1,
                          self.ends[0][0] if self.ends else end + 1)
            if soonest > end:
                break
            self._advance(soonest)
        return self._take()

    def _advance(self, t: float) -> None:
        """Up to t: arrivals come and go, and jobs that waited here end; either may let others start."""
        events, ahead, ends = self.events, self.ahead, self.ends
        last = len(events)
        while True:
            arrival = events[self.next][0] if self.next < last else None
            if ends and ends[0][0] <= t and (arrival is None or ends[0][0] < arrival):
                at, gpus = heapq.heappop(ends)
                self.returned += gpus
            elif arrival is not None and arrival <= t:
                at, rank, gpus = events[self.next]
                for lower in range(rank + 1, _CLASSES):
                    ahead[lower] += gpus
                self.next += 1
                if gpus > 0:
                    continue
            else:
                return
            if self.count:
                self._check(at)

    def _check(self, t: float) -> None:
        for rank, queue in enumerate(self.waiting):
            if queue:
                free = self.returned - self.ahead[rank]
                while queue and queue[0][0] <= free:
                    _, _, job_id, gpus, duration = heapq.heappop(queue)
                    self.count -= 1
                    self.due.append((job_id, t))
                    heapq.heappush(self.ends, (t + duration, gpus))

    def _take(self) -> list[tuple[str, float]]:
        due, self.due = self.due, []
        return due
