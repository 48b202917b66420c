"""Estimated start times: the queue simulated forward with the users' expected durations.

Algorithm overview
  1. Start from the free GPUs left after this cycle's decisions, and a calendar of releases:
     every running job ends at its expected end (a draining one at the end of its grace).
  2. At the current simulated time, start every job that fits, with the same placement code as
     the real cycle and the teams' maxima, in the order later cycles will admit them: first the
     jobs their team's guarantee covers, then the borrowers; each by class, then by how far the
     team is below its guarantee, then by place in the queue. What teams hold changes as the walk
     starts and ends jobs, so this order is worked out as it goes, not once.
  3. Jobs of one shape (GPU count, topology, eligible machines) are interchangeable for fitting:
     each team's jobs of a shape form a lane, and when a shape's first job finds no room, nothing
     else of that shape fits either until GPUs come back.
  4. The cycle's reservations hold their machines against every job but their holder, as
     admission holds them; a job that would have waited past the starvation threshold in the
     walk holds its soonest place too. Later jobs may use it only if they end before it starts.
     A claimant waiting for jobs about to end (admission, Preemption 1) holds the machines of
     its room until it starts against every job but the claimants admitted before it:
     admission keeps its free GPUs from whoever comes after it, however short.
  5. Advance to the next release, give its GPUs back, and repeat from 2.
  6. Work that arrives later is known only as a forecast (scheduler/forecast.py): a job that
     more important expected arrivals would go before waits, after its place in the walk, until
     the walk has given back those arrivals' GPUs as well. The simulator measures how far the
     estimates are from what happens (docs/eta.md). The walk does not preempt: a job that
     will reclaim or preempt is estimated to wait for releases.
"""

from __future__ import annotations

import heapq
from collections import deque
from types import MappingProxyType
from typing import Collection, Iterable, Mapping, NamedTuple, Sequence

from scheduler.capacity import NO_RESERVE, Capacity, KeepWhole, reserve_serves
from scheduler.forecast import ArrivalLoad
from scheduler.models import GpuSlot, Priority, QueuedJob, Topology
from scheduler.placement import NO_AVOID, picks_for
from scheduler.quotas import TeamUsage
from scheduler.reservation import Hold, ReleaseBook, plan_hold

_INF = float("inf")  # the share of a team without a guarantee: after every team with one
_CLASSES = len(Priority)
_ROOM = -2  # the place in the queue a claimant's room applies from (every job's, as a reservation's -1)
MIN_RUN = 60.0  # a queued job whose estimate has run out still needs a little time
STEP_FLOOR = 60.0
STEP_SHARE = 0.02


class Release(NamedTuple):
    """GPUs coming back at `at`: a running or just placed job's."""

    at: float
    slots: Sequence[GpuSlot]
    team: str
    gpus: int
    machines: list[tuple[int, int]] | None = None  # (machine, GPU count), when already known
    masks: list[tuple[int, int]] | None = None  # (machine, its GPUs as a bit mask): a running job's


def remaining_work(job: QueuedJob, restart: float = 0.0) -> float:
    """How long its next attempt should hold its GPUs; `restart` (PolicyConfig.expected_restart_s)
    is added when it resumes."""
    work = max(MIN_RUN, job.spec.expected_duration - job.progress)
    return work + restart if restart and job.resumes else work


class _Lane:
    """One team's jobs of one shape, in queue order: interchangeable for fitting."""

    __slots__ = ("jobs", "team", "limit", "covered_up_to", "aside", "fronted")

    def __init__(self, team: str, limit: int | None, guaranteed: int, n: int):
        # (class rank, place in the queue, job, remaining work, the job's part of its lane's turn)
        self.jobs: deque[tuple[int, int, QueuedJob, float, int]] = deque()
        self.team, self.limit = team, limit
        self.covered_up_to = guaranteed - n  # its team's guarantee covers the next job while it holds no more
        self.aside = False  # blocked until GPUs come back
        self.fronted: set[str] = set()  # reservation holders moved to its head (once each)


class _Shape:
    """Jobs that need the same GPUs (count, topology, eligible pools), one lane per team."""

    __slots__ = ("n", "terms", "pools", "topology", "lanes", "by_team", "offered", "second")

    def __init__(self, n: int, terms: tuple):
        self.n, self.terms = n, terms  # terms: Capacity.fit_terms of its jobs
        self.pools, _, self.topology = terms
        self.lanes: list[_Lane] = []
        self.by_team: dict[str, _Lane] = {}
        self.offered: _Lane | None = None  # the lane whose turn the shape's offer carries
        self.second = 0  # the next lane's turn when the offer was made (it can only be later); set by each offer


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
    keep_whole: KeepWhole = NO_RESERVE,
    wanted: Collection[str] | None = None,
    arrivals: ArrivalLoad | None = None,
    restart: float = 0.0,
    reservations: Sequence[Hold] = (),
    rooms: Sequence[Hold] = (),
    room_promises: Mapping[str, tuple[str, int]] = MappingProxyType({}),
) -> dict[str, float]:
    """Estimated start per pending job id; a job missing from the answer does not start within
    the horizon. With `wanted`, only those jobs are answered, and the walk stops once they have
    theirs: nothing it does later changes them. Mutates `cap` and `arrivals`."""
    left = len(pending) if wanted is None else sum(1 for job in pending if job.spec.job_id in wanted)
    if left == 0:
        return {}
    load = arrivals if arrivals else None
    late: set[int] = set()  # calendar entries of jobs that wait for expected arrivals
    # The calendar: (at, seq, team, GPU count, what the walk took or None, slots, machine counts,
    # a running job's GPUs as masks or None).
    calendar = [(at, seq, team, gpus, None, slots, machines, masks)
                for seq, (at, slots, team, gpus, machines, masks) in enumerate(releases)]
    heapq.heapify(calendar)
    seq = len(calendar)
    holds_left = max_holds  # holds come and go as holders start; bound the planning work
    held = dict(usage.used)
    for team, gpus in usage.promised.items():  # GPUs earmarked for a team's claimants count, as admission counts them
        held[team] = held.get(team, 0) + gpus
    for team, gpus in room_promises.values():  # and those of its claimants waiting for jobs about to end
        held[team] = held.get(team, 0) + gpus
    block_free = cap.block_free
    has_room = cap.has_room
    machine_wide = Topology.machine
    block_wide = Topology.block

    # Lanes: one per shape and team, so that admission's first pass can be followed (the jobs a
    # team's guarantee covers go before the borrowers). Jobs of one shape compete for the same
    # GPUs, so the walk takes the shapes in turn, and within a shape its best lane.
    shapes: dict[tuple, _Shape] = {}
    of_terms: dict[int, _Shape] = {}  # by the identity of the capacity's remembered fit terms
    total = sum(m.gpus for m in cap.machines)
    # The lanes that hold a holder of one of the cycle's reservations: only there can a hold keep
    # out the head of the holder's own lane (the walk's own holds apply to later jobs only).
    holders = {h.job_id for h in reservations} | {h.job_id for h in rooms}
    holder_lanes: set[_Lane] = set()
    # A lane's turn (see `turn`) is packed into one integer, so that turns compare as numbers do,
    # not as tuples: the walk compares them tens of thousands of times. Each part is below its
    # bound: the place in the queue below len(pending), the team's standing by share below the
    # number of teams, the class below the number of classes.
    teams = {job.spec.team for job in pending}
    by_share = len(pending)  # one step of a team's standing by share
    by_class = by_share * len(teams)
    borrower = by_class * _CLASSES  # any job its team's guarantee covers goes first
    never = 2 * borrower  # later than any lane's turn
    for order, job in enumerate(pending):
        s = job.spec
        terms = cap.fit_terms(s)
        shape = of_terms.get(id(terms))
        if shape is None:
            pools, _, topology = terms
            shape_key = (s.num_gpus, topology, tuple(id(p) for p in pools))
            shape = shapes.get(shape_key)
            if shape is None:
                shape = shapes[shape_key] = _Shape(s.num_gpus, terms)
            of_terms[id(terms)] = shape
        lane = shape.by_team.get(s.team)
        if lane is None:
            quota = usage.quota(s.team)
            limit = quota.max if quota.max is not None and quota.max < total else None
            lane = shape.by_team[s.team] = _Lane(s.team, limit, quota.guaranteed, s.num_gpus)
            shape.lanes.append(lane)
        class_rank = s.priority.rank
        lane.jobs.append((class_rank, order, job, remaining_work(job, restart), class_rank * by_class + order))
        if s.job_id in holders:
            holder_lanes.add(lane)

    # The reserved pool, as the cycles to come will keep it: a pool's whole machines are kept
    # only while a waiting job it serves has not started (admission._reserved_pool).
    keep = dict(keep_whole) if keep_whole else {}
    served_by: dict[tuple, list] = {}  # shape -> the pool keys it keeps whole machines in
    waiting_in: dict = {}  # pool key -> jobs of the walk it keeps whole machines for
    for shape_key, shape in shapes.items() if keep else ():
        keys = [p.key for p in shape.pools if p.key in keep and reserve_serves(p.key, keep[p.key], shape.n, shape.topology)]
        if keys:
            served_by[shape_key] = keys
            # Not for a job bigger than its team's maximum: it never starts, and the pool kept
            # for it told a job that does start that it never would ("estimated start unknown").
            count = sum(len(lane.jobs) for lane in shape.lanes if lane.limit is None or shape.n <= lane.limit)
            for key in keys:
                waiting_in[key] = waiting_in.get(key, 0) + count
    for key in [k for k in keep if not waiting_in.get(k)]:
        del keep[key]

    held_of = held.get
    guaranteed = {team: usage.quota(team).guaranteed for team in teams}
    standing: dict[str, int] = {}  # per team, its part of a lane's turn

    def take_shares() -> None:
        """How far each team is below its guarantee, as a cycle at this time would order the
        queue: as the team's standing among the teams (equal shares, equal standing)."""
        shares = {team: held_of(team, 0) / g if g else _INF for team, g in guaranteed.items()}
        level = {share: k * by_share for k, share in enumerate(sorted(set(shares.values())))}
        for team, share in shares.items():
            standing[team] = level[share]

    def turn(lane: _Lane) -> int:
        """Admission's order as the walk's starts change what teams hold: the jobs a team's
        guarantee covers first, then the borrowers; each by class, then by how far the team is
        below its guarantee (as of the last release: a cycle orders its queue once), then by
        place in the queue. Packed into one integer (see `by_share`); turns computed between
        the same two releases compare as the tuples (covered, class, share, place) would."""
        team = lane.team
        return lane.jobs[0][4] + standing[team] + (0 if held_of(team, 0) <= lane.covered_up_to else borrower)

    def best(shape: _Shape) -> tuple[int, _Lane] | None:
        """The shape's lane whose turn comes first; remembers the runner-up's turn."""
        found = None
        first = second = never
        for lane in shape.lanes:
            if lane.jobs and not lane.aside:
                team = lane.team  # turn(lane), written out: the walk's most run loop
                rank = lane.jobs[0][4] + standing[team] + (0 if held_of(team, 0) <= lane.covered_up_to else borrower)
                if rank < first:
                    second, first, found = first, rank, lane
                elif rank < second:
                    second = rank
        shape.offered = found
        shape.second = second
        return None if found is None else (first, found)

    ready: list[tuple[int, int, tuple]] = []  # (turn of the shape's best lane, seq, shape)

    def offer(shape_key: tuple) -> None:
        nonlocal seq
        found = best(shapes[shape_key])
        if found is not None:
            heapq.heappush(ready, (found[0], seq, shape_key))
            seq += 1

    take_shares()
    for shape_key in shapes:
        offer(shape_key)
    blocked: list[tuple] = []  # shapes to look at again when GPUs come back
    # (from which place in the queue it applies, hold). The cycle's own holds apply to every
    # job but their holder, as this cycle's admission held them against whoever came after.
    holds: list[tuple[int, Hold]] = [(-1, h) for h in reservations] + [(_ROOM, h) for h in rooms]
    room_rank = {h.job_id: k for k, h in enumerate(rooms)}  # in the order admission made them
    rooms_held = len(rooms)  # not reservations: they do not count towards max_holds

    def holds_may_grow() -> bool:
        return holds_left > 0 and len(holds) - rooms_held < max_holds

    def may_plan(shape: _Shape) -> bool:
        """Whether a job of the shape that finds no room may still plan a reservation: one of a
        whole machine or more of those it may use (admission._starving)."""
        return shape.n >= shape.terms[1] and holds_may_grow()

    raw: dict[str, float] = {}
    no_room: set[tuple] = set()  # (shape, machines kept out, pool exempt) found full since GPUs last came back
    avoid_cache: dict[tuple, frozenset[int]] = {}
    t = now
    end = now + horizon
    while True:
        while ready:
            rank, _, shape_key = heapq.heappop(ready)
            shape = shapes[shape_key]
            room = has_room(shape.pools, shape.topology, shape.n)
            if not room and not may_plan(shape):
                # The jobs offered before it took what came back, and nothing comes back before
                # the next release: whichever lane's turn it is, none fits, and none plans a hold.
                blocked.append(shape_key)
                continue
            lane = shape.offered
            # Between releases turns only get later (teams take GPUs, heads start), so the lane
            # offered is still the shape's best while its turn is no later than the runner-up's
            # was; only then is the shape looked at again.
            now_rank = turn(lane) if lane is not None and lane.jobs and not lane.aside else never
            if now_rank != rank:
                if now_rank > shape.second or now_rank == never:
                    found = best(shape)
                    if found is None:
                        continue
                    now_rank, lane = found
                if ready and ready[0][0] < now_rank:
                    heapq.heappush(ready, (now_rank, seq, shape_key))
                    seq += 1
                    continue
            _, order, job, duration, _ = lane.jobs[0]
            spec = job.spec
            n = shape.n
            promised = spec.job_id in room_promises  # its GPUs are counted already
            if lane.limit is not None and held.get(lane.team, 0) + (0 if promised else n) > lane.limit:
                lane.aside = True  # its team is at its maximum until some of its GPUs come back
                blocked.append(shape_key)
                offer(shape_key)
                continue
            avoid = NO_AVOID
            if holds:
                # A claimant's room holds against the claimants admitted after it, as admission
                # keeps its GPUs from them, not against those before it: claimants may share one
                # ending job's GPUs, each its own part (held each against the other, neither started).
                rank = room_rank.get(spec.job_id)
                applying = tuple(k for k, (h_order, h) in enumerate(holds)
                                 if h_order < order and t + duration > h.expected_start and h.job_id != spec.job_id
                                 and (rank is None or h_order != _ROOM or room_rank[h.job_id] < rank))
                if applying:
                    avoid = avoid_cache.get(applying)
                    if avoid is None:
                        avoid = avoid_cache[applying] = frozenset().union(*(holds[k][1].machines for k in applying))
            # Cheap test first: most blocked shapes are blocked because too little is free at all.
            picks = None
            # A claimant waiting for its room may displace others, and such a job takes the
            # reserved pool's GPUs rather than displace anyone (admission, step e): from the next
            # cycle on, as now it waits for its room instead.
            tried = (shape_key, avoid, t > now and spec.job_id in room_rank)
            if room and tried not in no_room:
                picks = picks_for(cap, shape.terms, n, avoid, NO_RESERVE if tried[2] else keep)
            if picks is None and avoid is not NO_AVOID and lane in holder_lanes and _holder_to_front(lane, applying, holds):
                # Kept out by the reservation of a job behind it in its own lane: admission takes
                # the holder first (a starving job, in its first pass), so the walk does too; left
                # behind, neither started in the walk.
                heapq.heappush(ready, (turn(lane), seq, shape_key))
                seq += 1
                continue
            if picks is None:
                blocked.append(shape_key)
                planning = may_plan(shape)
                if (
                    planning
                    and t - job.queued_since >= starvation_threshold
                    and all(h.job_id != spec.job_id for _, h in holds)
                ):
                    # The calendar per machine, made only here: planning is rare (bounded by
                    # max_holds), releases are many.
                    book = ReleaseBook((entry[0], _counts(cap, entry)) for entry in calendar)
                    taken = frozenset(i for _, h in holds for i in h.machines)
                    hold = plan_hold(cap, spec, book, t, taken)
                    holds_left -= 1
                    if hold is not None:
                        holds.append((order, hold))
                        avoid_cache.clear()
                if planning or (room and avoid is not NO_AVOID):
                    # Another lane of this shape may keep out of fewer reserved machines, or plan
                    # a reservation of its own.
                    no_room.add(tried)
                    lane.aside = True
                    offer(shape_key)
                # Otherwise no lane of the shape fits until GPUs come back: taking GPUs never
                # makes room.
                continue
            # A borrower waits, after its place in the walk, for the more important work expected
            # to arrive; a job its team's guarantee covers does not.
            if load is not None and held_of(spec.team, 0) > lane.covered_up_to and not load.started(
                    spec.job_id, lane.jobs[0][0], t, n, duration):
                late.add(seq)
            elif wanted is None or spec.job_id in wanted:
                raw[spec.job_id] = t
                left -= 1
                if left == 0:
                    return raw
            if not promised:
                held[spec.team] = held.get(spec.team, 0) + n
            heapq.heappush(calendar, (t + duration, seq, spec.team, n, cap.take_picks(picks), (), picks, None))
            seq += 1
            if holds and any(h.job_id == spec.job_id for _, h in holds):
                holds = [(o, h) for o, h in holds if h.job_id != spec.job_id]
                avoid_cache.clear()
                if spec.job_id in room_rank:
                    rooms_held -= 1
            lane.jobs.popleft()
            released_pool = False
            for key in served_by.get(shape_key, ()):
                waiting_in[key] -= 1
                if waiting_in[key] == 0 and key in keep:
                    del keep[key]  # the last job it was kept for has started: small jobs may use it
                    released_pool = True
            if released_pool:
                no_room.clear()
                for key in dict.fromkeys(blocked):
                    for other in shapes[key].lanes:
                        other.aside = False
                    offer(key)
                blocked = []
            # The same lane usually goes on: the others' turns have not come any sooner.
            if lane.jobs and (rank := turn(lane)) <= shape.second:
                heapq.heappush(ready, (rank, seq, shape_key))
                seq += 1
            else:
                offer(shape_key)
            if not any(block_free.values()) and not holds_may_grow():
                # Every GPU is taken (the usual end of a release's turn on a full cluster): the
                # shapes still waiting their turn would each be found without room.
                blocked.extend(key for _, _, key in ready)
                ready.clear()
        if not ready and (not (blocked or load and load.delaying) or not calendar or calendar[0][0] > end):
            break
        no_room.clear()
        # Releases close together are taken as one step: an estimate is good to a minute, or to
        # 2% of how far ahead it looks, and the walk's cost follows the number of steps.
        t = calendar[0][0]
        window = t + max(STEP_FLOOR, STEP_SHARE * (t - now))
        returned = 0
        placing = bool(blocked)  # once nothing is left to start, only the forecast counts releases
        while calendar and calendar[0][0] <= window:
            t, entry, team, gpus, taken, slots, _, masks = heapq.heappop(calendar)
            if placing:
                if taken is not None:
                    cap.give_back(taken)
                elif masks is not None:
                    cap.give_held(masks)
                else:
                    cap.give(slots)
                held[team] = held.get(team, 0) - gpus
            if entry not in late:
                returned += gpus
        if load is not None:
            for job_id, at in load.released(returned, t):
                if wanted is None or job_id in wanted:
                    raw[job_id] = at
                    left -= 1
            if left == 0:
                return raw
        if not placing:
            continue
        take_shares()
        # Retry only the shapes that the freed GPUs could possibly serve; the rest stay blocked.
        total = sum(block_free.values())
        largest = max((p.largest_free() for p in cap.pools.values()), default=0)
        in_block = max(block_free.values(), default=0)
        still = []
        for shape_key in dict.fromkeys(blocked):
            shape = shapes[shape_key]
            n, topology = shape.n, shape.topology
            if n > (largest if topology == machine_wide else in_block if topology == block_wide else total):
                still.append(shape_key)
            else:
                for lane in shape.lanes:
                    lane.aside = False
                offer(shape_key)
        blocked = still

    if load is not None:
        raw.update((job_id, at) for job_id, at in load.drain(end) if wanted is None or job_id in wanted)
    return raw


def _holder_to_front(lane: _Lane, applying: tuple[int, ...], holds: list[tuple[int, Hold]]) -> bool:
    """Move the first job of `lane` that holds one of the `applying` holds to its head; False when
    the lane holds none of them."""
    holders = {holds[k][1].job_id for k in applying} - lane.fronted
    for k, entry in enumerate(lane.jobs) if holders else ():
        job_id = entry[2].spec.job_id
        if k and job_id in holders:
            del lane.jobs[k]
            lane.jobs.appendleft(entry)
            lane.fronted.add(job_id)  # once: two holders each behind the other's hold end here
            return True
    return False


def _counts(cap: Capacity, entry: tuple) -> list[tuple[int, int]]:
    """(machine, GPU count) of a calendar entry's release."""
    return entry[6] if entry[6] is not None else cap.counts_of(entry[5])
