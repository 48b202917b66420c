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
     simulator measures how far that is from what happens (docs/results.md). It also walks in
     plain queue order, without preemption or admission's first pass for teams under their
     guarantee (docs/policy.md, step 7, says why).
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
    """GPUs coming back at `at`: a running or just placed job's."""

    at: float
    slots: Sequence[GpuSlot]
    team: str
    gpus: int
    machines: list[tuple[int, int]] | None = None  # (machine, GPU count), when already known


def remaining_work(job: QueuedJob) -> float:
    return max(MIN_RUN, job.spec.expected_duration - job.progress)


class _Lane:
    """Jobs of one shape, in queue order: interchangeable for fitting."""

    __slots__ = ("jobs", "n", "team", "limit", "pools", "topology")

    def __init__(self, n: int, team: str, limit: int | None, pools, topology: Topology):
        self.jobs: deque[tuple[int, QueuedJob, float]] = deque()  # (order, job, remaining work)
        self.n, self.team, self.limit, self.pools, self.topology = n, team, limit, pools, topology


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
) -> dict[str, float]:
    """Estimated start per pending job id; a job missing from the answer does not start within
    the horizon. Mutates `cap`."""
    # The calendar: (at, seq, team, GPU count, what the walk took or None, slots, machine counts).
    calendar = [(r.at, seq, r.team, r.gpus, None, r.slots, r.machines) for seq, r in enumerate(releases)]
    heapq.heapify(calendar)
    seq = len(calendar)
    holds_left = max_holds  # holds come and go as holders start; bound the planning work
    held = dict(usage.used)
    block_free = cap.block_free
    machine_wide = Topology.machine
    block_wide = Topology.block

    lanes: dict[tuple, _Lane] = {}
    total = sum(m.gpus for m in cap.machines)
    for order, job in enumerate(pending):
        s = job.spec
        pools, largest, topology = cap.fit_terms(s)
        # A team's maximum only splits a lane when it could ever bind.
        limit = usage.quota(s.team).max
        binding = limit is not None and limit < total
        key = (s.num_gpus, topology, tuple(id(p) for p in pools), s.team if binding else None)
        lane = lanes.get(key)
        if lane is None:
            lane = lanes[key] = _Lane(s.num_gpus, s.team, limit if binding else None, pools, topology)
        lane.jobs.append((order, job, remaining_work(job)))
    ready = [(lane.jobs[0][0], key) for key, lane in lanes.items()]
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
            _, job, duration = lane.jobs[0]
            spec = job.spec
            n = lane.n
            fits_quota = lane.limit is None or held.get(lane.team, 0) + n <= lane.limit
            avoid = NO_AVOID
            if holds:
                applying = tuple(k for k, (h_order, h) in enumerate(holds)
                                 if h_order < order and t + duration > h.expected_start)
                if applying:
                    avoid = avoid_cache.get(applying)
                    if avoid is None:
                        avoid = avoid_cache[applying] = frozenset().union(*(holds[k][1].machines for k in applying))
            # Cheap test first: most blocked lanes are blocked because too little is free at all.
            picks = None
            if fits_quota and cap.has_room(lane.pools, lane.topology, n):
                picks = find_picks(cap, spec, avoid=avoid, keep_whole=keep_whole)
            if picks is None:
                blocked.append(key)
                if (
                    fits_quota
                    and n >= cap.gpus_per_machine
                    and holds_left > 0
                    and len(holds) < max_holds
                    and t - job.queued_since >= starvation_threshold
                    and all(h_order != order for h_order, _ in holds)
                ):
                    # The calendar per machine, made only here: planning is rare (bounded by
                    # max_holds), releases are many.
                    book = ReleaseBook(cap, (), t)
                    for entry in calendar:
                        for i, count in _counts(cap, entry):
                            book.by_machine.setdefault(i, []).append((entry[0], count))
                    taken = frozenset(i for _, h in holds for i in h.machines)
                    hold = plan_hold(cap, spec, book, t, taken)
                    holds_left -= 1
                    if hold is not None:
                        holds.append((order, hold))
                        avoid_cache.clear()
                continue
            raw[spec.job_id] = t
            held[spec.team] = held.get(spec.team, 0) + n
            heapq.heappush(calendar, (t + duration, seq, spec.team, n, cap.take_picks(picks), (), picks))
            seq += 1
            if holds and any(o == order for o, _ in holds):
                holds = [(o, h) for o, h in holds if o != order]
                avoid_cache.clear()
            lane.jobs.popleft()
            if lane.jobs:
                heapq.heappush(ready, (lane.jobs[0][0], key))
        if not ready and (not blocked or not calendar or calendar[0][0] > end):
            break
        # Releases close together are taken as one step: an estimate is good to a minute, or to
        # 2% of how far ahead it looks, and the walk's cost follows the number of steps.
        t = calendar[0][0]
        window = t + max(STEP_FLOOR, STEP_SHARE * (t - now))
        while calendar and calendar[0][0] <= window:
            t, _, team, gpus, taken, slots, _ = heapq.heappop(calendar)
            if taken is not None:
                cap.give_back(taken)
            else:
                cap.give(slots)
            held[team] = held.get(team, 0) - gpus
        # Retry only the lanes that the freed GPUs could possibly serve; the rest stay blocked.
        total = sum(block_free.values())
        largest = max((p.largest_free() for p in cap.pools.values()), default=0)
        in_block = max(block_free.values(), default=0)
        still = []
        for key in blocked:
            lane = lanes[key]
            n, topology = lane.n, lane.topology
            if n > (largest if topology == machine_wide else in_block if topology == block_wide else total):
                still.append(key)
            else:
                heapq.heappush(ready, (lane.jobs[0][0], key))
        blocked = still

    return raw


def _counts(cap: Capacity, entry: tuple) -> list[tuple[int, int]]:
    """(machine, GPU count) of a calendar entry's release."""
    if entry[6] is not None:
        return entry[6]
    counts: dict[int, int] = {}
    for machine_id, _ in entry[5]:
        i = cap.index.get(machine_id)
        if i is not None:
            counts[i] = counts.get(i, 0) + 1
    return list(counts.items())
