"""Step 5 of the cycle: admit the queue, one job at a time.

Who comes first: every job its team's guarantee still covers (what the team holds, the GPUs
promised to its waiting jobs and this job are within its guarantee, as it stands when the job's
turn comes) and every large job that may hold a reservation (step g; the jobs behind it must
respect it), then the jobs that would borrow; each group in queue order. GPUs that a team under
its guarantee is waiting for are not idle, so they are not lent: a borrower of any class that
took them would be reclaimed by preemption as soon as its minimum runtime is over, losing its
work since its last checkpoint.

For each job, the first of these that applies decides:
  a. it would take its team over its maximum: it waits;
  b. it holds an earmark (GPUs promised when it preempted or was moved): it starts on exactly those
     GPUs once all of them are free, and waits until then;
  c. it fits on free GPUs (bin-packed), leaving alone machines held for a starving job unless it
     will end before that job starts (backfill): it is placed;
  d. its preemption victims are still draining: it waits for them;
  e. it may displace others: if GPUs free up on their own within the grace period it waits for
     them, else the victims that really let it start are preempted and the GPUs it will get are
     earmarked, so no other job takes them as the victims leave;
  f. it needs one machine or one block, has waited `consolidation_wait`, and small jobs that can
     checkpoint could move into idle gaps elsewhere to clear that room: they are moved
     (consolidation.py), and the room and their new GPUs are earmarked;
  g. it is a large gang job that has waited past the starvation threshold: it holds the place
     where it fits soonest, by when GPUs come back (coming_back.py: promised GPUs only after the
     job they are promised to);
  h. otherwise it waits, with the reason in words.
Capacity only shrinks during admission, so a shape that found no GPUs (or no victims) is not
searched again in the same cycle; the exception, a claimant breaking a whole machine of the
reserved pool (step e), forgets the shapes that found no GPUs.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate
from operator import or_
from typing import NamedTuple

from scheduler import consolidation, eta, in_words, placement, preemptible, preemption, reservation
from scheduler.capacity import NO_RESERVE, Capacity, KeepWhole, reserve_serves
from scheduler.coming_back import gpus_coming_back
from scheduler.expected_ends import Ends
from scheduler.expected_ends import expected_ends as ends_of_running
from scheduler.models import (
    Earmark,
    GpuSlot,
    PolicyConfig,
    Preemption,
    Priority,
    QueuedJob,
    RunningJob,
    Snapshot,
    Topology,
)
from scheduler.quotas import TeamUsage

_LOWEST = max(p.rank for p in Priority)  # a claimant of this class displaces nobody by class
KEPT_WHOLE = "the last whole machines are kept for jobs that need a whole machine"


@dataclass
class Admission:
    """What admission reads (the cycle's scratch state) and what it has decided so far."""

    cap: Capacity
    usage: TeamUsage
    running: list[RunningJob]
    now: float
    config: PolicyConfig
    keep_whole: KeepWhole  # the reserved pool: whole machines kept per pool for the large jobs waiting
    draining_for: dict[str, list[RunningJob]]  # claimant -> its victims still draining
    exposed: preemption.Exposed  # running jobs not protected from preemption (or a move), found when asked
    # decisions
    placed: list[tuple[QueuedJob, tuple[GpuSlot, ...], bool]] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    going: set[str] = field(default_factory=set)  # running jobs told to leave this cycle
    requeued: frozenset[str] = frozenset()  # of those, the ones health moves off (a drain, a sick GPU; a lost one is gone)
    orphaned: set[str] = field(default_factory=set)  # victims leaving whose claimant's promise broke or who left
    holds: list[reservation.Hold] = field(default_factory=list)
    held_machines: frozenset[int] = placement.NO_AVOID  # every machine of `holds`
    # The holds' starts, soonest first, and held_before[k]: the machines of the k soonest holds.
    hold_starts: list[float] = field(default_factory=list)
    held_before: list[frozenset[int]] = field(default_factory=lambda: [placement.NO_AVOID])
    earmarks: dict[str, Earmark] = field(default_factory=dict)
    earmark_free: dict[str, list[GpuSlot]] = field(default_factory=dict)  # taken out of capacity
    claimants: dict[str, QueuedJob] = field(default_factory=dict)  # waiting jobs promised GPUs (some placed since)
    waiting: list[tuple[QueuedJob, str]] = field(default_factory=list)  # in queue order
    wake_at: list[float] = field(default_factory=list)  # when decisions put off are to be taken again
    # remembered within the cycle
    no_fit: set[tuple] = field(default_factory=set)
    no_victims: set[tuple] = field(default_factory=set)
    no_moves: set[tuple] = field(default_factory=set)
    searches: int = 0
    consolidations: int = 0
    movable: dict[object, dict] = field(default_factory=dict)  # per domain kind: jobs a move may take, by domain
    victim_keys: dict[str, tuple] = field(default_factory=dict)
    # by claimant rights, in victim order with their keys; some may be going
    candidates: dict[tuple, list[tuple[tuple, RunningJob]]] = field(default_factory=dict)
    ends: Ends | None = None  # see expected_ends
    ending_soon: list[tuple[str, int, int]] | None = None  # (job, machine, GPUs) of jobs ending soon (_frees_up_soon)
    ending_by_machine: tuple[int, dict[int, int]] | None = None  # (len(going) it was made at, GPUs per machine)
    # Claimants waiting for jobs that end soon, by id (see RoomWait)
    room_waits: dict[str, RoomWait] = field(default_factory=dict)
    # The ending jobs' GPUs those claimants counted, per machine: their room, not the next one's
    ending_counted: dict[int, int] = field(default_factory=dict)
    book: reservation.ReleaseBook | None = None  # see _release_book
    book_made_at: tuple[int, int, int] | None = None
    explained: dict[tuple, str] = field(default_factory=dict)
    settled: dict[tuple, str] = field(default_factory=dict)  # jobs alike that waited at step h
    # by preemption key: what protection keeps from a claimant that found nobody to displace
    protected_notes: dict[tuple, str] = field(default_factory=dict)
    protected: list[tuple[RunningJob, float | None]] | None = None  # see preemption.protected_jobs


def begin(snapshot: Snapshot, cap: Capacity, usage: TeamUsage, running: list[RunningJob],
          leaving: set[str], queue: list[QueuedJob]) -> Admission:
    now, config = snapshot.now, snapshot.config
    exposed_now = preemptible.exposed_now(snapshot.cluster, running, now, config)
    usage.preemptible = exposed_now
    state = Admission(
        cap=cap, usage=usage, running=running, now=snapshot.now, config=config, keep_whole=NO_RESERVE,
        draining_for=_draining_for(running),
        exposed=preemption.Exposed(running, exposed_now, exposed_now.unprotected), going=set(leaving),
        requeued=frozenset(leaving),
    )
    _hold_earmarks(snapshot, state)
    _orphan_victims_of_departed_claimants(snapshot, state)
    state.keep_whole = _reserved_pool(cap, _without_promises(state, queue), config, usage)
    return state


def _without_promises(state: Admission, queue: list[QueuedJob]) -> list[QueuedJob]:
    """The jobs the reserved pool may be kept for: not those promised GPUs elsewhere (an
    earmark), which start on those; a machine was kept idle for one, and a job told it was kept
    for "jobs that need a whole machine" that would start only after the claimant had."""
    if not state.earmarks:
        return queue
    return [job for job in queue if job.spec.job_id not in state.earmarks]


def admit_queue(state: Admission, queue: list[QueuedJob]) -> None:
    """Admit the queue (in queue order): the jobs within their team's guarantee first, then the
    rest. A large job that may hold a reservation keeps its place among the first, so that the
    jobs behind it respect its reservation as before. `state.waiting` comes out in queue order."""
    usage = state.usage
    borrowing = []
    for job in queue:
        if usage.under_guarantee_with(job.spec.team, job.spec.num_gpus) or _starving(state, job):
            admit(state, job)
        else:
            borrowing.append(job)
    for job in borrowing:
        admit(state, job)
    # Both passes after the first, and the jobs admitted again once the pool is served, append to
    # `waiting` out of queue order.
    served_again = bool(state.keep_whole and state.placed and _after_the_pool_served(state))
    if borrowing or served_again:
        place = {job.spec.job_id: i for i, job in enumerate(queue)}
        state.waiting.sort(key=lambda waiting: place[waiting[0].spec.job_id])
    for wait in state.room_waits.values():  # free again for what reads the capacity after admission: the walk
        state.cap.give_back(wait.kept)
        state.usage.promise(wait.team, -wait.gpus)  # the walk counts them when it starts the claimant


def _after_the_pool_served(state: Admission) -> bool:
    """A job kept off the reserved pool is admitted again when the jobs the pool was kept for
    have started later in the same cycle: left waiting, it would stand beside free GPUs it fits
    until the next cycle, told it starts now. Whether any was.

    Those told so, and those waiting for GPUs to come back (victims leaving, or jobs about to
    end): the pool may have kept them off free GPUs before they came to wait so. A claimant
    waiting for jobs about to end gives back the free GPUs it kept, so the jobs that found no
    room after it, on machines of those pools, come again too."""
    pool_of, waits = state.cap.pool_of, state.room_waits
    kept_pools = {pool_of[i] for wait in waits.values() for i, gpus in wait.kept if gpus}
    no_room = set(state.settled.values()) if kept_pools else set()  # the reasons of jobs that found none

    def may_start_now(job: QueuedJob, reason: str) -> bool:
        job_id = job.spec.job_id
        return (KEPT_WHOLE in reason or job_id in waits
                or (job_id in state.draining_for and job_id not in state.earmarks)
                or (reason in no_room and not kept_pools.isdisjoint(state.cap.eligible_pools(job.spec))))

    kept_out = [job for job, reason in state.waiting if may_start_now(job, reason)]
    if not kept_out:
        return False
    keep = _reserved_pool(state.cap, _without_promises(state, [job for job, _ in state.waiting]), state.config,
                          state.usage)
    if keep == state.keep_whole:
        return False
    state.keep_whole = keep
    for answers in (state.settled, state.explained, state.no_fit, state.no_victims, state.no_moves):
        answers.clear()  # given with the pool kept
    again = {job.spec.job_id for job in kept_out}
    state.waiting = [w for w in state.waiting if w[0].spec.job_id not in again]
    if any(h.job_id in again for h in state.holds):
        # A reservation made while the pool was kept goes with the answer it came with: the job
        # is placed now, or reserves again (one job, one reservation).
        _set_holds(state, [h for h in state.holds if h.job_id not in again])
    for job in kept_out:
        _stop_waiting_for_room(state, job.spec.job_id)
        admit(state, job)
    return True


def _stop_waiting_for_room(state: Admission, job_id: str) -> None:
    """Undo a claimant's wait for jobs about to end, to admit it again: the free GPUs it kept,
    the ending ones it counted and its team's promise are everyone's again."""
    if job_id not in state.room_waits:
        return
    wait = state.room_waits.pop(job_id)
    state.cap.give_back(wait.kept)
    state.usage.promise(wait.team, -wait.gpus)
    for i, count in wait.room.ending.items():
        state.ending_counted[i] -= count


def admit(state: Admission, job: QueuedJob) -> None:
    spec = job.spec
    usage = state.usage
    # a. maximum (a job's own earmark is promised to it already)
    more = 0 if spec.job_id in state.earmarks else spec.num_gpus
    if not usage.within_max(spec.team, more):
        limit = usage.quota(spec.team).max
        if spec.num_gpus > limit:  # the maximum was lowered below the job after it was accepted
            state.waiting.append((job, f"asks for {in_words.gpus(spec.num_gpus)}, more than team {spec.team}'s "
                                       f"maximum of {limit}: it cannot start until the maximum is raised "
                                       "(gpusched quota set) or it is cancelled"))
            return
        promised = usage.promised.get(spec.team, 0)
        also = f", {promised} promised to its waiting jobs" if promised else ""
        numbers = f"{usage.held(spec.team)} of {limit} GPUs held{also}"
        if usage.held(spec.team) + promised >= limit:
            state.waiting.append((job, f"team {spec.team} is at its maximum ({numbers})"))
        else:  # a smaller job of the team would start: "at its maximum" would not be true
            state.waiting.append((job, f"team {spec.team} would pass its maximum with this job's "
                                       f"{in_words.gpus(spec.num_gpus)} ({numbers})"))
        return
    # b. earmark
    earmark = state.earmarks.get(spec.job_id)
    if earmark is not None:
        if len(state.earmark_free[spec.job_id]) == len(earmark.gpus):
            del state.earmarks[spec.job_id]
            usage.promise(spec.team, -spec.num_gpus)
            usage.add(spec.team, spec.num_gpus)
            state.placed.append((job, earmark.gpus, False))
        else:
            state.waiting.append((job, _waiting_for_victims(state.draining_for.get(spec.job_id, []), state.now)))
        return
    # c. free GPUs
    avoid = _held_against(state, job)
    # A job just like one that already came out at step h, with nothing decided since, fares the
    # same: it waits for the same reason. This keeps a long queue of blocked jobs cheap.
    # (How long it has waited counts: past the consolidation wait a job may have others moved
    # for it, past the starvation threshold hold a reservation; a job queued just now, sorted
    # ahead, may do neither.)
    waited = state.now - job.queued_since
    like = (_shape(job), spec.team, spec.priority, avoid, waited >= state.config.starvation_threshold,
            waited >= state.config.consolidation_wait, len(state.placed), len(state.earmarks), len(state.holds),
            len(state.preemptions), len(state.room_waits))
    if like in state.settled and spec.job_id not in state.draining_for:
        state.waiting.append((job, state.settled[like]))
        return
    slots = _place(state, job, avoid)
    if slots is not None:
        _start_on(state, job, slots)
        return
    # d. victims still draining
    if state.draining_for.get(spec.job_id):
        state.waiting.append((job, _waiting_for_victims(state.draining_for[spec.job_id], state.now)))
        return
    # e. preemption
    if _preempt_for(state, job, avoid):
        return
    # f. consolidation
    if _consolidate_for(state, job, avoid):
        return
    # g. reservation
    if _reserve(state, job, avoid):
        return
    # h. wait
    reason = _why_waiting(state, job, avoid)
    if state.protected_notes:  # rare: most cycles have no claimant that protection alone keeps waiting
        note = state.protected_notes.get(_preemption_key(job, avoid))
        if note:
            reason = f"{reason}; {note}"
    state.settled[like] = reason
    state.waiting.append((job, reason))


def _starving(state: Admission, job: QueuedJob) -> bool:
    """A job that may hold a reservation: a whole machine or more, waiting past the threshold.
    (Small jobs are not starved by fragmentation: any freed GPU fits them.) A whole machine of
    those it may use: a 4-GPU job of 4-GPU machines is one, whatever bigger machines of another
    type or partition the cluster has."""
    return (state.now - job.queued_since >= state.config.starvation_threshold
            and job.spec.num_gpus >= state.cap.fit_terms(job.spec)[1])


def _reserve(state: Admission, job: QueuedJob, avoid: frozenset[int]) -> bool:
    spec, cap, config = job.spec, state.cap, state.config
    if not _starving(state, job) or len(state.holds) >= config.max_reservations:
        return False
    taken = state.held_machines
    if state.room_waits:  # nor where a claimant waits for jobs about to end: their GPUs are its
        taken = taken.union(*(wait.machines() for wait in state.room_waits.values()))
    hold = reservation.plan_hold(cap, spec, _release_book(state), state.now, taken)
    if hold is None:
        return False
    _add_hold(state, hold)
    why = _why_waiting(state, job, avoid)
    state.waiting.append((job, f"{why}; holds a reservation, expected to start "
                                f"{in_words.from_now(hold.expected_start, state.now)}"))
    return True


def _release_book(state: Admission) -> reservation.ReleaseBook:
    """When each machine's GPUs come back, as far as this cycle has decided: a job told to leave
    gives back at the end of its grace, GPUs promised to a job only once it has run on them, a
    job placed this cycle at the end of its run. Made again only when a decision since could
    change it: placements and those told to leave only grow, and a promise goes only as its job
    is placed."""
    made_at = (len(state.placed), len(state.earmarks), len(state.going))
    if state.book is None or state.book_made_at != made_at:
        back, _ = gpus_coming_back(state, expected_ends(state))
        counts_of = state.cap.counts_of
        state.book = reservation.ReleaseBook(
            (at, machines if machines is not None else counts_of(slots)) for at, _, slots, machines, _ in back)
        state.book_made_at = made_at
    return state.book


def _hold_earmarks(snapshot: Snapshot, state: Admission) -> None:
    """Keep promised GPUs out of everyone else's reach; drop promises that lapsed or broke."""
    if not snapshot.earmarks:  # most cycles: nothing promised
        return
    cap = state.cap
    # A job moved by a consolidation keeps the GPUs it restarts on while it checkpoints.
    waiting = {job.spec.job_id: job for job in snapshot.queue}
    holders = waiting.keys() | {j.spec.job_id for j in snapshot.running if j.draining_until is not None}
    healthy = cap.layout.healthy_mask
    for earmark in snapshot.earmarks:
        if earmark.expires <= snapshot.now or earmark.job_id not in holders:
            continue
        usable = all(m in cap.index and healthy[cap.index[m]] >> g & 1 for m, g in earmark.gpus)
        if not usable:
            # Its victims' GPUs will not all be usable (a machine drained or lost, a GPU sick):
            # it looks for GPUs again instead of waiting for them (step d), and the GPUs they do
            # give back are anyone's, as a cancelled job's are (_frees_up_soon).
            _leave_for_nobody(state, earmark.job_id)
            continue
        claimant = waiting.get(earmark.job_id)
        if claimant is not None and not state.usage.within_max(claimant.spec.team, claimant.spec.num_gpus):
            # Its team's maximum was lowered under it since the promise: it cannot start on them,
            # and kept, they stood idle until the promise lapsed (the victim waiting beside them).
            # The promise is dropped: its victims leave for nobody (_orphan_victims_of_departed_claimants).
            continue
        free = [(m, g) for m, g in earmark.gpus if g in cap.free[cap.index[m]]]
        cap.take(free)
        state.earmarks[earmark.job_id] = earmark
        state.earmark_free[earmark.job_id] = free
        if claimant is not None:  # a mover's GPUs count already: it still holds its old ones
            state.claimants[earmark.job_id] = claimant
            state.usage.promise(claimant.spec.team, claimant.spec.num_gpus)


def _orphan_victims_of_departed_claimants(snapshot: Snapshot, state: Admission) -> None:
    """A victim whose claimant no longer waits (cancelled, or started elsewhere), or waits over
    its team's maximum without a promise (the maximum lowered under it: its earmark was dropped
    in an earlier cycle), still leaves at the end of its grace, for nobody: its GPUs are anyone's,
    as a cancelled job's are (_frees_up_soon). Counted as its claimant's, they made the next
    claimant displace a second job for GPUs that were coming free anyway."""
    if not state.draining_for:
        return
    waiting = {job.spec.job_id: job for job in snapshot.queue}

    def departed(claimant: str) -> bool:
        job = waiting.get(claimant)
        return job is None or (claimant not in state.earmarks
                               and not state.usage.within_max(job.spec.team, job.spec.num_gpus))

    for claimant in [c for c in state.draining_for if departed(c)]:
        _leave_for_nobody(state, claimant)


def _leave_for_nobody(state: Admission, claimant: str) -> None:
    """The claimant's victims still draining leave for nobody: their GPUs are no longer its."""
    for victim in state.draining_for.pop(claimant, ()):
        state.orphaned.add(victim.spec.job_id)


def _waiting_for_victims(victims: list[RunningJob], now: float) -> str:
    if not victims:
        return "waiting for the GPUs earmarked for it to be released"
    grace_end = max(v.draining_until or now for v in victims)
    return (f"waiting for {len(victims)} preempted job(s) to checkpoint and release their GPUs "
            f"(grace ends {in_words.from_now(grace_end, now)})")


def _shape(job: QueuedJob) -> tuple:
    s = job.spec
    return (s.num_gpus, s.topology, s.gpu_type, s.gpu_memory_gb, s.kind)


def _reserved_pool(cap: Capacity, queue: list[QueuedJob], config: PolicyConfig, usage: TeamUsage) -> KeepWhole:
    """Per pool, the whole machines small jobs must leave whole: the reserved pool's share of
    the pool's machines, where some waiting job needs whole machines of it, those alone could
    host it, and its team's maximum lets it start.

    A job bigger than a pool's reserve waits for its reservation instead, and one that may not
    run on the pool (another partition, GPU type, or one machine larger than the pool's) never
    uses it, nor one whose team is at its maximum until it gives GPUs back: keeping machines
    idle for them would only waste GPUs. Nor is the reserve larger than the pool's machines that
    can be whole at all (no sick GPU, taking work): a job only more of them could host would
    never start there. The share is of the machines in service (taking work, not drained)."""
    fraction = config.reserved_pool_fraction
    if not fraction or cap.gpus_per_machine == 0:
        return NO_RESERVE
    layout = cap.layout
    reserves = {}
    machines = cap.machines
    for pool in cap.pools.values():
        members = pool.members
        can_be_whole = (len(members) if layout.all_healthy
                        else sum(1 for i in members if len(layout.healthy[i]) == pool.key.gpus))
        # A share of the machines in service: one cordoned or drained is as one that is down.
        serving = (len(members) if layout.all_healthy
                   else sum(1 for i in members if machines[i].takes_work and not machines[i].drain))
        reserve = min(math.ceil(fraction * serving), can_be_whole)
        if reserve:
            reserves[pool.key] = reserve
    smallest = min((key.gpus for key in reserves), default=0)
    kept: dict = {}
    asked: set[tuple] = set()
    for job in queue:
        spec = job.spec
        if spec.num_gpus < smallest:
            continue
        shape = (spec.kind, spec.gpu_type, spec.gpu_memory_gb, spec.num_gpus, spec.topology)
        if shape in asked or not usage.within_max(spec.team, spec.num_gpus):
            continue
        asked.add(shape)
        pools, _, topology = cap.fit_terms(spec)
        for pool in pools:
            reserve = reserves.get(pool.key)
            if reserve and reserve_serves(pool.key, reserve, spec.num_gpus, topology):
                kept[pool.key] = reserve
        if len(kept) == len(reserves):
            break
    return kept or NO_RESERVE


def _draining_for(running: list[RunningJob]) -> dict[str, list[RunningJob]]:
    out: dict[str, list[RunningJob]] = {}
    for job in running:
        if job.preempted_for and job.draining:
            out.setdefault(job.preempted_for, []).append(job)
    return out


def _held_against(state: Admission, job: QueuedJob, starts_in: float = 0.0) -> frozenset[int]:
    """Machines held for a starving job that this job would still occupy when it starts (in
    `starts_in` seconds): those of the holds that start before it would end, the soonest holds."""
    if not state.holds:
        return placement.NO_AVOID
    ends = state.now + starts_in + eta.remaining_work(job, state.config.expected_restart_s)
    return state.held_before[bisect_left(state.hold_starts, ends)]


def _add_hold(state: Admission, hold: reservation.Hold) -> None:
    _set_holds(state, [*state.holds, hold])


def _set_holds(state: Admission, holds: list[reservation.Hold]) -> None:
    state.holds = holds
    # Each job asks which holds it would run into: a union per count of holds, made here once,
    # instead of one per job. One hold (the usual case) is its own answer: the same frozenset,
    # its hash already known.
    soonest = sorted(holds, key=lambda h: h.expected_start)
    state.hold_starts = [h.expected_start for h in soonest]
    state.held_before = [placement.NO_AVOID, *accumulate((h.machines for h in soonest), or_)]
    state.held_machines = state.held_before[-1]


def _place(state: Admission, job: QueuedJob, avoid: frozenset[int]):
    key = (_shape(job), avoid)
    if key in state.no_fit:
        return None
    slots = placement.find_gpus(state.cap, job.spec, avoid=avoid, keep_whole=state.keep_whole)
    if slots is None:
        state.no_fit.add(key)
    return slots


def _start_on(state: Admission, job: QueuedJob, slots) -> None:
    """Place the job on free GPUs now."""
    state.cap.take(slots)
    state.usage.add(job.spec.team, job.spec.num_gpus)
    state.placed.append((job, slots, _on_hold(state, slots)))


def _on_hold(state: Admission, slots) -> bool:
    """Whether a placement lands on machines held for a reservation: backfilled ahead of it."""
    index = state.cap.index
    return any(index[m] in h.machines for h in state.holds for m, _ in slots)


def _preempt_for(state: Admission, job: QueuedJob, avoid: frozenset[int]) -> bool:
    cap, usage, running, now, config = state.cap, state.usage, state.running, state.now, state.config
    spec = job.spec
    key = _preemption_key(job, avoid)
    if key in state.no_victims or state.searches >= config.max_preemption_searches:
        return False
    exposed = state.exposed
    reclaim = usage.under_guarantee_with(spec.team, spec.num_gpus)
    rights = (spec.priority.rank, spec.team, reclaim)
    ranked = state.candidates.get(rights)
    if ranked is None:
        ranked = state.candidates[rights] = preemption.in_victim_order(
            preemption.displaceable(spec, exposed, usage), now, usage, state.victim_keys)
    going = state.going
    if not any(j.spec.job_id not in going for _, j in ranked):
        state.no_victims.add(key)
        note = _protection_note(state, spec, reclaim)
        if note:
            state.protected_notes[key] = note
        return False
    # Asked only of a job that may displace someone: one that may not waits (and may hold a
    # reservation) whatever ends soon.
    # Its room frees within a grace: the holds it would still be running into are those from then.
    soon = _frees_up_soon(state, spec, _held_against(state, job, config.grace_period))
    if soon is not None:
        state.waiting.append((job, "enough GPUs are expected to free up within half the grace period, or "
                                   "as jobs already stopping end their grace; waiting for them instead of "
                                   "preempting"))
        # If they have not by then (estimates are wrong both ways), the claimant preempts.
        state.wake_at.append(now + config.grace_period / 2 + 1.0)
        # Kept from the jobs behind it: handed to them, the free GPUs it counted were gone when
        # the wait ended, and it displaced someone after all. Only those: holding their machines
        # whole made the jobs behind displace others instead (Philly week: 3,302 preemptions to
        # 3,585).
        for i, count in soon.ending.items():
            state.ending_counted[i] = state.ending_counted.get(i, 0) + count
        counted = frozenset(job_id for job_id, i, _ in state.ending_soon if i in soon.ending and job_id not in going)
        state.room_waits[spec.job_id] = RoomWait(state.cap.take_picks(soon.free), soon, counted, spec.team,
                                                 spec.num_gpus)
        # Promised to it while admission goes on, as an earmark is: a job of its team behind it
        # took the team's headroom, and the claimant found itself over its maximum by its room.
        state.usage.promise(spec.team, spec.num_gpus)
        return True
    # The victims' placement may use the reserved pool: a claimant entitled to displace work
    # takes free GPUs kept whole there rather than cost a job its work (policy.md, Preemption 1).
    # Asked before the victims are searched: with a victim's GPUs given back, best fit would
    # choose the victim's now tighter machine over the pool's free one.
    slots = placement.find_gpus(cap, spec, avoid=avoid) if state.keep_whole else None
    if slots is not None:
        _start_on(state, job, slots)
        # The one way capacity grows for the rest: a whole machine it broke is no longer kept,
        # and its other free GPUs are anyone's.
        state.no_fit.clear()
        return True
    state.searches += 1
    if state.room_waits:
        # Nor the jobs about to end whose GPUs a claimant ahead waits for: displaced for this
        # one, they would cost their work to hand it GPUs promised to the claimant ahead.
        going = going.union(*(wait.jobs for wait in state.room_waits.values()))
    choice = preemption.choose_victims(cap, spec, ranked, avoid, going)
    if choice is None:
        state.no_victims.add(key)
        return False
    if not choice.victims:
        # The placement with the victims gone needs none of their GPUs after all: it starts now,
        # displacing nobody.
        _start_on(state, job, choice.gpus)
        return True
    _promise_claimant(state, job, choice.gpus)
    for victim in choice.victims:
        state.going.add(victim.spec.job_id)
        state.preemptions.append(
            Preemption(
                job_id=victim.spec.job_id,
                for_job=spec.job_id,
                reason=preemption.displacement_reason(spec, victim),
                grace_period=config.grace_period,
            )
        )
    names = ", ".join(v.spec.job_id for v in choice.victims)
    state.waiting.append((job, f"preempting {names}; starts when they have checkpointed (grace "
                               f"{config.grace_period:.0f} s)"))
    return True


def _protection_note(state: Admission, spec, reclaim: bool) -> str | None:
    """What protection keeps from a claimant that found nobody to displace. Most such claimants
    are of the lowest class and do not reclaim: nobody could be displaced for them at all."""
    if not reclaim and spec.priority.rank == _LOWEST:
        return None
    if state.protected is None:  # once per cycle, and only in a cycle that needs it
        state.protected = preemption.protected_jobs(state.running, state.usage.preemptible, state.now, state.config)
    return preemption.protected_below(spec, state.protected, state.usage, state.now)


def _preemption_key(job: QueuedJob, avoid: frozenset[int]) -> tuple:
    """Claimants alike for the preemption search: the same shape, class, team and machines kept out."""
    return (_shape(job), job.spec.priority, job.spec.team, avoid)


def expected_ends(state: Admission) -> Ends:
    """(expected end, job, its GPUs, (machine, GPU count) of them, how many) for every running
    job, in order (expected_ends.End).

    Asked by the check for GPUs freeing up soon, by reservations and by the estimate: worked out
    once per cycle instead of once by each."""
    if state.ends is None:
        state.ends = ends_of_running(state.cap.layout, state.running, state.now, state.config.expected_restart_s)
    return state.ends


def _promise(state: Admission, job_id: str, gpus: tuple[GpuSlot, ...]) -> None:
    """Earmark `gpus` for `job_id`: those free now leave the capacity, the rest follow as the
    jobs on them leave. A promise not taken up within twice the grace and a minute lapses."""
    cap = state.cap
    free_now = [(m, g) for m, g in gpus if g in cap.free[cap.index[m]]]
    cap.take(free_now)
    state.earmarks[job_id] = Earmark(job_id=job_id, gpus=gpus, expires=state.now + 2 * state.config.grace_period + 60.0)
    state.earmark_free[job_id] = free_now


def _promise_claimant(state: Admission, job: QueuedJob, gpus: tuple[GpuSlot, ...]) -> None:
    """Earmark `gpus` for a waiting job; its team is about to hold them, so from now they count
    towards its guarantee. (A mover's new GPUs do not: it still holds its old ones.)"""
    _promise(state, job.spec.job_id, gpus)
    state.claimants[job.spec.job_id] = job
    state.usage.promise(job.spec.team, job.spec.num_gpus)


def _consolidate_for(state: Admission, job: QueuedJob, avoid: frozenset[int]) -> bool:
    cap, now, config, spec = state.cap, state.now, state.config, job.spec
    # The class too: which jobs may be moved depends on it (a low claimant that found none to
    # move kept a high one of the same shape from looking).
    key = (_shape(job), spec.priority, avoid)
    if (
        state.consolidations >= config.max_consolidations
        or now - job.queued_since < config.consolidation_wait
        or key in state.no_moves
    ):
        return False
    kind = consolidation.domain_kind(cap, spec)
    # Movers only trade places with idle GPUs: with fewer idle than the job needs, none can help.
    if kind is None or cap.total_free(cap.eligible_pools(spec)) < spec.num_gpus:
        return False
    if _frees_up_soon(state, spec, avoid) is not None:
        return False
    movable = state.movable.get(kind)
    if movable is None:
        movable = state.movable[kind] = consolidation.movable_by_domain(cap, kind, state.exposed.jobs)
    state.consolidations += 1
    plan = consolidation.plan_move(cap, spec, kind, movable, now, avoid, state.going, state.keep_whole,
                                   reserved=state.held_machines)
    if plan is None:
        state.no_moves.add(key)
        return False
    _promise_claimant(state, job, plan.gpus)
    for move in plan.moves:
        mover = move.job.spec.job_id
        state.going.add(mover)
        cap.give(move.to)  # plan_move held them while it placed the other movers; now promised
        _promise(state, mover, move.to)
        state.preemptions.append(Preemption(job_id=mover, for_job=spec.job_id, grace_period=config.grace_period,
                                            reason=consolidation.move_reason(spec, move), moved_to=move.to))
    names = ", ".join(move.job.spec.job_id for move in plan.moves)
    state.waiting.append((job, f"moving {names} elsewhere to make room for it; starts when they have "
                               f"checkpointed (grace {config.grace_period:.0f} s)"))
    return True


class SoonRoom(NamedTuple):
    """Room for a claimant made by jobs ending soon: the free GPUs it needs beside theirs,
    (machine, count), and how many of the ending jobs' GPUs it counts, per machine."""
    free: list[tuple[int, int]]
    ending: dict[int, int]


class RoomWait(NamedTuple):
    """A claimant waiting for jobs that end soon. Until admission is done, the free GPUs it
    counted are kept from the jobs behind it (`kept`, take_picks' form), and the jobs ending on
    the machines of its room (`jobs`) are displaced for none of them."""
    kept: list[tuple[int, list[int]]]
    room: SoonRoom
    jobs: frozenset[str]
    team: str  # its team, promised its GPUs until admission is done
    gpus: int

    def machines(self) -> frozenset[int]:
        """The machines of its room."""
        return frozenset(self.room.ending).union(i for i, _ in self.room.free)

    def hold(self, job_id: str, now: float) -> reservation.Hold:
        """In the estimate's walk, the machines of its room are held for it until it starts
        (from now: nobody backfills it), where the walk had the jobs behind it start on the
        GPUs it kept."""
        return reservation.Hold(job_id, self.machines(), now)


def _frees_up_soon(state: Admission, spec, avoid: frozenset[int]) -> SoonRoom | None:
    """Whether jobs ending by their estimates free room for `spec` before a preemption would,
    beside the room counted by the claimants waiting for them already: if so, that room.

    Preempting costs the victims a checkpoint and a restart; if the GPUs come free on their own
    within half the grace period, waiting is hardly slower for the claimant and costs nobody
    anything. (Half: if the estimate was wrong, preempting then still starts the claimant within
    about one grace period.) A job already stopping for nobody (a cancel, or a victim whose
    claimant's earmark broke), or told this cycle to move off (its machine drained, a GPU of it
    sick), is sure to leave by the end of its grace: if that is within a grace period, a
    preemption would free nothing sooner.
    A victim's GPUs are its claimant's (`preempted_for`)."""
    cap, now = state.cap, state.now
    if state.ending_soon is None:
        half, whole = now + state.config.grace_period / 2, now + state.config.grace_period
        requeued = state.requeued  # told this cycle to stop for nobody: gone by the end of a grace
        orphaned = state.orphaned
        # Most jobs end after a grace period from now and are not requeued: two tests each.
        state.ending_soon = [(running.spec.job_id, i, count) for end, running, _, machines, _ in expected_ends(state)
                             if (end <= whole and (
                                 end <= half if running.draining_until is None
                                 else running.preempted_for is None or running.spec.job_id in orphaned))
                             or (requeued and running.spec.job_id in requeued)
                             for i, count in machines]
    pools = cap.eligible_pools(spec)
    pool_of = cap.pool_of
    # Only machines with a job ending soon or a free GPU can add anything: on a busy cluster
    # that is a handful, not the fleet. Not the jobs preempted or moved so far this cycle: their
    # GPUs are their claimants'.
    if state.ending_by_machine is None or state.ending_by_machine[0] != len(state.going):  # `going` only grows
        by_machine: dict[int, int] = {}
        for job_id, i, count in state.ending_soon:
            if job_id not in state.going or job_id in state.requeued:
                by_machine[i] = by_machine.get(i, 0) + count
        state.ending_by_machine = (len(state.going), by_machine)
    counted = state.ending_counted
    ending = {i: count - counted.get(i, 0) for i, count in state.ending_by_machine[1].items()
              if i not in avoid and pool_of[i] in pools and count > counted.get(i, 0)}
    if not ending:
        return None
    n = spec.num_gpus
    free = cap.free
    topology = placement.resolved_topology(cap, spec)
    if topology == Topology.machine:
        fits = [i for i, count in ending.items() if len(free[i]) + count >= n]
        if not fits:
            return None
        best = max(fits, key=lambda i: (ending[i], -i))  # most of its room the ending jobs': the fewest kept
        return SoonRoom([(best, n - ending[best])] if n > ending[best] else [], {best: min(n, ending[best])})
    soon: dict[int, int] = dict(ending)
    for pool in pools:
        for bucket in pool.buckets[1:]:
            for i in bucket:
                if i not in avoid:
                    soon[i] = soon.get(i, 0) + len(free[i])
    if topology == Topology.block:
        per_block: dict[str, int] = {}
        block_of = cap.block_of
        for i, v in soon.items():
            per_block[block_of[i]] = per_block.get(block_of[i], 0) + v
        blocks = [b for b, v in per_block.items() if v >= n]
        if not blocks:
            return None
        soon = {i: v for i, v in soon.items() if block_of[i] == min(blocks)}
    elif sum(soon.values()) < n:
        return None
    # The fewest machines that make the room, those of the ending jobs first, then the freest;
    # and of their free GPUs only as many as the ending jobs' leave it short.
    chosen, room = [], 0
    for i, v in sorted(soon.items(), key=lambda item: (item[0] not in ending, -item[1], item[0])):
        chosen.append(i)
        room += v
        if room >= n:
            break
    counts, short = {}, n
    for i in chosen:
        count = min(ending.get(i, 0), short)
        if count > 0:
            counts[i] = count
            short -= count
    picks = []
    for i in chosen:
        keep = min(len(free[i]), short)
        if keep > 0:
            picks.append((i, keep))
            short -= keep
    return SoonRoom(picks, counts)


def _why_waiting(state: Admission, job: QueuedJob, avoid: frozenset[int]) -> str:
    # Capacity only shrinks as the cycle places and earmarks, so one answer per shape holds until then.
    key = (_shape(job), avoid, len(state.placed), len(state.earmarks), len(state.room_waits))
    if key not in state.explained:
        state.explained[key] = _explain(state, job.spec, avoid)
    return state.explained[key]


def _explain(state: Admission, spec, avoid: frozenset[int]) -> str:
    cap, keep_whole = state.cap, state.keep_whole
    held = bool(avoid) and placement.find_gpus(cap, spec, keep_whole=keep_whole) is not None  # fits on held machines
    kept = bool(keep_whole) and placement.find_gpus(cap, spec, avoid=avoid) is not None  # fits on those kept whole
    if held != kept:
        return _behind(state, spec, avoid) if held else KEPT_WHOLE
    if held or (avoid and keep_whole and placement.find_gpus(cap, spec) is not None):
        # Both: it fits on either, or only on both together (the room in words would say it
        # fits). So said, it is admitted again once the pool is served.
        return f"{_behind(state, spec, avoid)}, and {KEPT_WHOLE}"
    return placement.explain_no_fit(cap, spec)


def _behind(state: Admission, spec, avoid: frozenset[int]) -> str:
    """Named by the first hold on machines the job may use: one on others keeps nothing from it."""
    pools, pool_of = state.cap.eligible_pools(spec), state.cap.pool_of
    holders = [h.job_id for h in state.holds if any(pool_of[i] in pools for i in h.machines & avoid)] or \
              [h.job_id for h in state.holds if h.machines & avoid]
    return f"behind the reservation of job {holders[0]}"
