"""Estimated start times: the queue simulated forward with the users' expected durations.

Algorithm overview
  1. Start from the free GPUs left after this cycle's decisions, and a calendar of releases:
     every running job ends at its expected end (a draining one at the end of its grace).
  2. Walk the queue in order at the current simulated time and start every job that fits,
     with the same placement code as the real cycle and the teams' maxima. Jobs of identical
     shape are interchangeable for fitting, so each shape is one lane: when a lane's first job
     does not fit, nothing behind it in that lane does either.
  3. A job that would have waited past the starvation threshold holds its soonest place, as
     the real cycle does; later jobs may use it only if they end before it starts.
  4. Advance to the next release, give its GPUs back, and repeat from 2.
  5. What it does not know: work that arrives later. A more important job submitted tomorrow
     will overtake, so the estimate is a start time *if no more important work arrives*; the
     simulator measures how far that is from what happens (docs/results.md).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from scheduler.capacity import Capacity
from scheduler.models import GpuSlot, QueuedJob, Topology
from scheduler.placement import NO_AVOID, find_picks
from scheduler.quotas import TeamUsage
from scheduler.reservation import Hold, ReleaseBook, plan_hold

MIN_RUN = 60.0  # a queued job whose estimate has run out still needs a little time
STEP_FLOOR = 60.0
STEP_SHARE = 0.02


@dataclass
class Release:
    """GPUs coming back at `at`: a running job's slots, or what the walk itself took."""

    at: float
    slots: Sequence[GpuSlot]
    team: str
    gpus: int
    machines: list[tuple[int, int]] | None = None  # (machine, GPU count), filled on first use
    taken: list[tuple[int, list[int]]] | None = None  # set for jobs the walk started


def remaining_work(job: QueuedJob) -> float:
    return max(MIN_RUN, job.spec.expected_duration - job.progress)


def estimate_starts(
    cap: Capacity,
    releases: Iterable[Release],
    pending: Sequence[QueuedJob],
    usage: TeamUsage,
    now: float,
    *,
    starvation_threshold: float,
    max_holds: int,
    horizon: float,
    keep_whole: float = 0.0,
) -> dict[str, float | None]:
    """Estimated start per pending job id (None: not within the horizon). Mutates `cap`."""
    calendar = [(r.at, seq, r) for seq, r in enumerate(releases)]
    heapq.heapify(calendar)
    seq = len(calendar)
    book: ReleaseBook | None = None  # the calendar per machine, made when a hold is first planned
    holds_left = max_holds  # holds come and go as holders start; bound the planning work
    held = dict(usage.used)

    lanes: dict[tuple, deque[tuple[int, QueuedJob]]] = {}
    total = sum(m.gpus for m in cap.machines)
    for order, job in enumerate(pending):
        s = job.spec
        pools = cap.eligible_pools(s)
        largest = max((p.key.gpus for p in pools), default=0)
        # A team's maximum only splits a lane when it could ever bind.
        limit = usage.quota(s.team).max
        team = s.team if limit is not None and limit < total else None
        key = (s.num_gpus, s.topology_for(largest), tuple(id(p) for p in pools), team)
        lanes.setdefault(key, deque()).append((order, job))
    ready = [(lane[0][0], key) for key, lane in lanes.items()]
    heapq.heapify(ready)
    blocked: list[tuple] = []
    holds: list[tuple[int, Hold]] = []  # (order of the holder, hold)

    raw: dict[str, float] = {}
    avoid_cache: dict[tuple, frozenset[int]] = {}
    t = now
    end = now + horizon
    while True:
        while ready:
            order, key = heapq.heappop(ready)
            lane = lanes[key]
            job = lane[0][1]
            spec = job.spec
            limit = usage.quota(spec.team).max
            fits_quota = limit is None or held.get(spec.team, 0) + spec.num_gpus <= limit
            duration = remaining_work(job)
            avoid = NO_AVOID
            if holds:
                applying = tuple(k for k, (h_order, h) in enumerate(holds)
                                 if h_order < order and t + duration > h.expected_start)
                if applying:
                    avoid = avoid_cache.get(applying)
                    if avoid is None:
                        avoid = avoid_cache[applying] = frozenset().union(*(holds[k][1].machines for k in applying))
            # Cheap test first: most blocked lanes are blocked because too little is free at all.
            enough = fits_quota and cap.could_fit(spec)
            picks = find_picks(cap, spec, avoid=avoid, keep_whole=keep_whole) if enough else None
            if picks is None:
                blocked.append(key)
                if (
                    fits_quota
                    and spec.num_gpus >= cap.gpus_per_machine
                    and holds_left > 0
                    and len(holds) < max_holds
                    and t - job.queued_since >= starvation_threshold
                    and all(h_order != order for h_order, _ in holds)
                ):
                    if book is None:
                        book = ReleaseBook(cap, (), t)
                        for at, _, waiting in calendar:
                            _enter(cap, book, at, waiting)
                    taken = frozenset(i for _, h in holds for i in h.machines)
                    hold = plan_hold(cap, spec, book, t, taken)
                    holds_left -= 1
                    if hold is not None:
                        holds.append((order, hold))
                        avoid_cache.clear()
                continue
            raw[spec.job_id] = t
            held[spec.team] = held.get(spec.team, 0) + spec.num_gpus
            release = Release(t + duration, (), spec.team, spec.num_gpus, picks, cap.take_picks(picks))
            heapq.heappush(calendar, (release.at, seq, release))
            if book is not None:
                _enter(cap, book, release.at, release)
            seq += 1
            if any(o == order for o, _ in holds):
                holds = [(o, h) for o, h in holds if o != order]
                avoid_cache.clear()
            lane.popleft()
            if lane:
                heapq.heappush(ready, (lane[0][0], key))
        if not ready and (not blocked or not calendar or calendar[0][0] > end):
            break
        # Releases close together are taken as one step: an estimate is good to a minute, or to
        # 2% of how far ahead it looks, and the walk's cost follows the number of steps.
        t = calendar[0][0]
        window = t + max(STEP_FLOOR, STEP_SHARE * (t - now))
        while calendar and calendar[0][0] <= window:
            t, _, release = heapq.heappop(calendar)
            if book is not None:
                _leave(cap, book, release.at, release)
            if release.taken is not None:
                cap.give_back(release.taken)
            else:
                cap.give(release.slots)
            held[release.team] = held.get(release.team, 0) - release.gpus
        # Retry only the lanes that the freed GPUs could possibly serve; the rest stay blocked.
        total = sum(cap.block_free.values())
        largest = max((p.largest_free() for p in cap.pools.values()), default=0)
        in_block = max(cap.block_free.values(), default=0)
        still = []
        for key in blocked:
            n, topology = key[0], key[1]
            if n > (largest if topology == Topology.machine else in_block if topology == Topology.block else total):
                still.append(key)
            else:
                heapq.heappush(ready, (lanes[key][0][0], key))
        blocked = still

    return {job.spec.job_id: raw.get(job.spec.job_id) for job in pending}


def _counts(cap: Capacity, release: Release) -> list[tuple[int, int]]:
    if release.machines is None:
        counts: dict[int, int] = {}
        for machine_id, _ in release.slots:
            i = cap.index.get(machine_id)
            if i is not None:
                counts[i] = counts.get(i, 0) + 1
        release.machines = list(counts.items())
    return release.machines


def _enter(cap: Capacity, book: ReleaseBook, at: float, release: Release) -> None:
    for i, count in _counts(cap, release):
        book.by_machine.setdefault(i, []).append((at, count))


def _leave(cap: Capacity, book: ReleaseBook, at: float, release: Release) -> None:
    for i, count in _counts(cap, release):
        book.by_machine[i].remove((at, count))
