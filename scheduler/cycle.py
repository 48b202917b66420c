"""One scheduling cycle: a snapshot in, decisions out. The live loop and the simulator call this.

The cycle, step by step:
  1. Health — jobs on unreachable machines or sick GPUs must leave; those GPUs leave the inventory.
  2. Capacity — a scratch copy of the free GPUs; the snapshot itself is never changed.
  3. Quotas — what each team holds and which running jobs are borrowed capacity.
  4. Order — the queue in its total order (ordering.py).
  5. Admit, in order, each job:
     a. within its team's maximum, or it waits;
     a'. a job holding an earmark starts on its earmarked GPUs once all of them are free;
     b. placed on free GPUs (bin-packed), leaving alone machines held for a starving job unless
        it would finish before that job starts (backfill);
     c. else, if it may displace others, preempt the victims that really let it start, and
        earmark the GPUs it will get so that no other job takes them as the victims leave;
     d. else, if it has waited past the starvation threshold, hold the place it fits soonest;
     e. else it waits, with the reason in words.
  6. Stagger — each placed job that checkpoints gets a checkpoint phase.
  7. Estimate — positions, estimated starts and deadline risk for every job still waiting.
  8. Wake — the next time the cycle could decide differently even if nothing happens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler import eta, health, ordering, placement, preemption, quotas, reservation, staggering
from scheduler.capacity import Capacity
from scheduler.models import (
    CycleResult,
    Earmark,
    GpuSlot,
    Pending,
    Placement,
    Preemption,
    QueuedJob,
    Reservation,
    RunningJob,
    Snapshot,
    Topology,
    gpu_path,
)


@dataclass
class Admission:
    """Step 5's working state: what this cycle has decided so far."""

    placed: list[tuple[QueuedJob, tuple[GpuSlot, ...], bool]] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    going: set[str] = field(default_factory=set)  # running jobs told to leave this cycle
    holds: list[reservation.Hold] = field(default_factory=list)
    earmarks: dict[str, Earmark] = field(default_factory=dict)
    earmark_free: dict[str, list[GpuSlot]] = field(default_factory=dict)  # taken out of capacity
    waiting: list[tuple[QueuedJob, str]] = field(default_factory=list)
    no_fit: set[tuple] = field(default_factory=set)  # shapes that found no GPUs this cycle
    no_victims: set[tuple] = field(default_factory=set)
    victim_keys: dict[str, tuple] = field(default_factory=dict)
    exposed: list[RunningJob] | None = None  # running jobs not protected from preemption
    candidates: dict[tuple, list[RunningJob]] = field(default_factory=dict)
    ending_soon: dict[int, int] | None = None  # GPUs per machine whose jobs end within the grace
    explained: dict[tuple, str] = field(default_factory=dict)
    searches: int = 0


def run_cycle(snapshot: Snapshot) -> CycleResult:
    now, config = snapshot.now, snapshot.config

    # 1. Health
    requeues = health.jobs_to_requeue(snapshot.machines, snapshot.running)
    lost = {r.job_id for r in requeues if not r.graceful}
    leaving = {r.job_id for r in requeues}
    running = [j for j in snapshot.running if j.spec.job_id not in lost]

    # 2. Capacity
    cap = Capacity(snapshot.machines, held=[slot for job in running for slot in job.gpus])

    # 3. Quotas
    usage = quotas.team_usage(snapshot.quotas, running)

    # 4. Order
    queue = ordering.ordered_queue(snapshot.queue, usage)

    # 5. Admit
    state = Admission(going=set(leaving))
    _hold_earmarks(cap, snapshot, state)
    draining_for = _draining_for(running)
    keep_whole = config.reserved_pool_fraction if _big_job_waiting(cap, queue) else 0.0
    book = None
    for job in queue:
        spec = job.spec
        if not usage.within_max(spec.team, spec.num_gpus):
            quota = usage.quota(spec.team)
            state.waiting.append(
                (job, f"team {spec.team} is at its maximum ({usage.held(spec.team)} of {quota.max} GPUs held)")
            )
            continue
        earmark = state.earmarks.get(spec.job_id)
        if earmark is not None:
            if len(state.earmark_free[spec.job_id]) == len(earmark.gpus):
                del state.earmarks[spec.job_id]
                usage.add(spec.team, spec.num_gpus)
                state.placed.append((job, earmark.gpus, False))
            else:
                state.waiting.append((job, _waiting_for_victims(draining_for.get(spec.job_id, []), now)))
            continue
        avoid = _held_against(job, state.holds, now)
        slots = _place(cap, job, avoid, keep_whole, state)
        if slots is not None:
            cap.take(slots)
            usage.add(spec.team, spec.num_gpus)
            on_hold = any(cap.index[m] in h.machines for h in state.holds for m, _ in slots)
            state.placed.append((job, slots, on_hold))
            continue
        if draining_for.get(spec.job_id):
            state.waiting.append((job, _waiting_for_victims(draining_for[spec.job_id], now)))
            continue
        if _preempt_for(cap, job, running, usage, now, config, state, avoid):
            continue
        if (
            spec.num_gpus >= cap.gpus_per_machine  # a large gang job: fragmentation can starve it
            and now - job.queued_since >= config.starvation_threshold
            and len(state.holds) < config.max_reservations
        ):
            if book is None:
                book = reservation.ReleaseBook(cap, running, now)
            taken = frozenset(i for h in state.holds for i in h.machines)
            hold = reservation.plan_hold(cap, spec, book, now, taken)
            if hold is not None:
                state.holds.append(hold)
                state.waiting.append(
                    (job, f"{_why_waiting(cap, job, placement.NO_AVOID, keep_whole, state)}; holds a reservation, expected to start "
                          f"at {hold.expected_start:.0f}")
                )
                continue
        state.waiting.append((job, _why_waiting(cap, job, avoid, keep_whole, state)))

    # 6. Stagger
    placements = _with_checkpoint_phases(state.placed, running, now, config)

    # 7. Estimate
    pending = _estimate(cap, snapshot, running, usage, state, placements, keep_whole)

    # 8. Wake
    return CycleResult(
        placements=tuple(placements),
        preemptions=tuple(state.preemptions),
        requeues=tuple(requeues),
        reservations=tuple(
            Reservation(job_id=h.job_id, machines=tuple(sorted(cap.machines[i].id for i in h.machines)),
                        expected_start=h.expected_start)
            for h in state.holds
        ),
        pending=tuple(pending),
        earmarks=tuple(state.earmarks.values()),
        next_wake=_next_wake(snapshot, running, state, cap, usage),
    )


def _hold_earmarks(cap: Capacity, snapshot: Snapshot, state: Admission) -> None:
    """Keep promised GPUs out of everyone else's reach; drop promises that lapsed or broke."""
    queued = {job.spec.job_id for job in snapshot.queue}
    for earmark in snapshot.earmarks:
        if earmark.expires <= snapshot.now or earmark.job_id not in queued:
            continue
        usable = all(
            m in cap.index and g not in cap.machines[cap.index[m]].unhealthy_gpus for m, g in earmark.gpus
        )
        if not usable:
            continue
        free = [(m, g) for m, g in earmark.gpus if g in cap.free[cap.index[m]]]
        cap.take(free)
        state.earmarks[earmark.job_id] = earmark
        state.earmark_free[earmark.job_id] = free


def _waiting_for_victims(victims: list[RunningJob], now: float) -> str:
    if not victims:
        return "waiting for the GPUs earmarked for it to be released"
    grace_end = max(v.draining_until or now for v in victims)
    return (f"waiting for {len(victims)} preempted job(s) to checkpoint and release their GPUs "
            f"(grace ends at {grace_end:.0f})")


def _shape(job: QueuedJob) -> tuple:
    s = job.spec
    return (s.num_gpus, s.topology, s.gpu_type, s.gpu_memory_gb, s.kind)


def _big_job_waiting(cap: Capacity, queue: list[QueuedJob]) -> bool:
    return cap.gpus_per_machine > 0 and any(j.spec.num_gpus >= cap.gpus_per_machine for j in queue)


def _draining_for(running: list[RunningJob]) -> dict[str, list[RunningJob]]:
    out: dict[str, list[RunningJob]] = {}
    for job in running:
        if job.draining and job.preempted_for:
            out.setdefault(job.preempted_for, []).append(job)
    return out


def _held_against(job: QueuedJob, holds: list[reservation.Hold], now: float) -> frozenset[int]:
    """Machines held for a starving job that this job would still occupy when it starts."""
    if not holds:
        return placement.NO_AVOID
    ends = now + eta.remaining_work(job)
    return frozenset(i for h in holds if ends > h.expected_start for i in h.machines)


def _place(cap, job, avoid, keep_whole, state: Admission):
    key = (_shape(job), avoid)
    if key in state.no_fit:
        return None
    slots = placement.find_gpus(cap, job.spec, avoid=avoid, keep_whole=keep_whole)
    if slots is None:
        state.no_fit.add(key)
    return slots


def _preempt_for(cap, job, running, usage, now, config, state: Admission, avoid) -> bool:
    spec = job.spec
    key = (_shape(job), spec.priority, spec.team, avoid)
    if key in state.no_victims or state.searches >= config.max_preemption_searches:
        return False
    if _frees_up_soon(cap, spec, running, now, config, state, avoid):
        state.waiting.append((job, "enough GPUs are expected to free up within the grace period; "
                                   "waiting for them instead of preempting"))
        return True
    if state.exposed is None:
        state.exposed = preemption.unprotected(running, now, config)
    reclaim = usage.under_guarantee_with(spec.team, spec.num_gpus)
    rights = (spec.priority.rank, spec.team if reclaim else None, len(state.going))
    candidates = state.candidates.get(rights)
    if candidates is None:
        candidates = state.candidates[rights] = [
            j for j in preemption.displaceable(spec, state.exposed, usage) if j.spec.job_id not in state.going
        ]
    if not candidates:
        state.no_victims.add(key)
        return False
    state.searches += 1
    choice = preemption.choose_victims(cap, spec, candidates, now, usage, state.victim_keys, avoid)
    if choice is None:
        state.no_victims.add(key)
        return False
    free_now = [(m, g) for m, g in choice.gpus if g in cap.free[cap.index[m]]]
    cap.take(free_now)
    state.earmarks[spec.job_id] = Earmark(
        job_id=spec.job_id, gpus=choice.gpus, expires=now + 2 * config.grace_period + 60.0
    )
    state.earmark_free[spec.job_id] = free_now
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


def _frees_up_soon(cap, spec, running, now, config, state: Admission, avoid) -> bool:
    """Whether jobs ending by their estimates free room for `spec` before a preemption would.

    Preempting costs the victims a checkpoint and a restart; if the GPUs come free on their own
    within the grace period, waiting is no slower for the claimant and costs nobody anything."""
    if state.ending_soon is None:
        state.ending_soon = {}
        horizon = now + config.grace_period
        for job in running:
            if not job.draining and job.spec.job_id not in state.going and job.expected_end(now) <= horizon:
                for i, count in cap.machines_of(job):
                    state.ending_soon[i] = state.ending_soon.get(i, 0) + count
    pools = cap.eligible_pools(spec)
    machines = [i for p in pools for i in p.members if i not in avoid]
    n = spec.num_gpus
    ending = state.ending_soon
    if not any(i in ending for i in machines):
        return False
    soon = {i: len(cap.free[i]) + ending.get(i, 0) for i in machines}
    topology = placement.resolved_topology(cap, spec, pools)
    if topology == Topology.machine:
        return any(v >= n for i, v in soon.items() if i in ending)
    if topology == Topology.block:
        per_block: dict[str, int] = {}
        for i, v in soon.items():
            block = cap.machines[i].block
            per_block[block] = per_block.get(block, 0) + v
        return any(v >= n for v in per_block.values())
    return sum(soon.values()) >= n


def _why_waiting(cap, job, avoid, keep_whole, state: Admission) -> str:
    # Capacity only shrinks as the cycle places and earmarks, so one answer per shape holds until then.
    key = (_shape(job), avoid, keep_whole, len(state.placed), len(state.earmarks))
    if key not in state.explained:
        state.explained[key] = _explain(cap, job.spec, avoid, keep_whole, state)
    return state.explained[key]


def _explain(cap, spec, avoid, keep_whole, state: Admission) -> str:
    if avoid and placement.find_gpus(cap, spec, keep_whole=keep_whole) is not None:
        holders = [h.job_id for h in state.holds if h.machines & avoid]
        return f"behind the reservation of job {holders[0]}"
    if keep_whole and placement.find_gpus(cap, spec, avoid=avoid) is not None:
        return "the last whole machines are kept for jobs that need a whole machine"
    return placement.explain_no_fit(cap, spec)


def _with_checkpoint_phases(placed, running: list[RunningJob], now: float, config) -> list[Placement]:
    intervals = [j.spec.checkpoint_interval for j in running if j.spec.checkpoints]
    intervals += [q.spec.checkpoint_interval for q, _, _ in placed if q.spec.checkpoints]
    plan = staggering.WritePlan(config.checkpoint_slot, staggering.plan_period(intervals))
    if config.stagger_checkpoints and any(q.spec.checkpoints for q, _, _ in placed):
        for j in running:
            if j.spec.checkpoints:
                phase = j.checkpoint_phase if j.checkpoint_phase is not None else j.started_at
                plan.add(j.spec.checkpoint_interval, phase, j.spec.num_gpus)
    out = []
    for job, slots, backfilled in placed:
        spec = job.spec
        phase = None
        if spec.checkpoints:
            if config.stagger_checkpoints:
                phase = plan.choose(spec.checkpoint_interval, spec.num_gpus)
            else:
                phase = now % spec.checkpoint_interval
        gpus = ", ".join(gpu_path(s) for s in slots[:4]) + (" …" if len(slots) > 4 else "")
        reason = f"{spec.num_gpus} GPU(s) free: {gpus}"
        if backfilled:
            reason += " (backfilled: ends before the reservation it shares machines with)"
        out.append(Placement(job_id=spec.job_id, gpus=slots, reason=reason, checkpoint_phase=phase,
                             backfilled=backfilled))
    return out


def _estimate(cap, snapshot: Snapshot, running, usage, state: Admission, placements,
              keep_whole: float) -> list[Pending]:
    now, config = snapshot.now, snapshot.config
    if not state.waiting:
        return []
    if not snapshot.estimate:
        return [Pending(job_id=job.spec.job_id, position=position, estimated_start=None,
                        misses_deadline=None, reason=reason)
                for position, (job, reason) in enumerate(state.waiting, start=1)]
    releases = []
    for job in running:
        at = now + config.grace_period if job.spec.job_id in state.going else job.expected_end(now)
        releases.append(eta.Release(at, job.gpus, job.spec.team, job.spec.num_gpus, cap.machines_of(job)))
    for (job, slots, _), p in zip(state.placed, placements):
        at = now + eta.remaining_work(job)
        releases.append(eta.Release(at, p.gpus, job.spec.team, job.spec.num_gpus))
    in_order = state.waiting  # appended in queue order
    starts = eta.estimate_starts(
        cap.clone(),
        releases,
        [job for job, _ in in_order],
        usage,
        now,
        starvation_threshold=config.starvation_threshold,
        max_holds=config.max_reservations,
        horizon=config.eta_horizon,
        keep_whole=keep_whole,
    )
    out = []
    for position, (job, reason) in enumerate(in_order, start=1):
        start = starts.get(job.spec.job_id)
        deadline = job.spec.deadline
        misses = None
        if deadline is not None:
            misses = start is None or start + eta.remaining_work(job) > deadline
        out.append(Pending(job_id=job.spec.job_id, position=position, estimated_start=start,
                           misses_deadline=misses, reason=reason))
    return out


def _next_wake(snapshot: Snapshot, running: list[RunningJob], state: Admission, cap: Capacity,
               usage: quotas.TeamUsage) -> float | None:
    """Only what could change a decision: a large job reaching the starvation threshold, or a
    protection ending on a job that some waiting job would be allowed to displace."""
    if not state.waiting:
        return None
    now, config = snapshot.now, snapshot.config
    times = [
        job.queued_since + config.starvation_threshold
        for job, _ in state.waiting
        if job.spec.num_gpus >= cap.gpus_per_machine
    ]
    most_important = min(job.spec.priority.rank for job, _ in state.waiting)
    reclaiming = any(usage.under_guarantee_with(j.spec.team, j.spec.num_gpus) for j, _ in state.waiting)
    for job in running:
        if job.draining_until is not None:
            times.append(job.draining_until)
            continue
        if job.spec.priority.rank <= most_important and not (reclaiming and job.spec.job_id in usage.borrowed):
            continue  # nobody waiting may displace it, protected or not
        times.append(job.started_at + config.min_runtime)
        recent = sorted(t for t in job.preemptions if now - t <= config.thrash_window)
        if len(recent) >= config.thrash_max_preemptions:
            times.append(recent[-config.thrash_max_preemptions] + config.thrash_window + 1.0)
    future = [t for t in times if t > now]
    return min(future) if future else None
