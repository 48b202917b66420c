"""One scheduling cycle: a snapshot in, decisions out. The live loop and the simulator call this.

The cycle, step by step:
  1. Health — jobs on unreachable machines or sick GPUs must leave; those GPUs leave the inventory.
  2. Capacity — a scratch copy of the free GPUs; the snapshot itself is never changed.
  3. Quotas — what each team holds and which running jobs are borrowed capacity.
  4. Order — the queue in its total order (ordering.py).
  5. Admit — each job is placed, preempts, reserves or waits (admission.py): first the jobs their
     team's guarantee covers, then those that would borrow, each in queue order.
  6. Stagger — each placed job that checkpoints gets a checkpoint phase.
  7. Estimate — positions, estimated starts and deadline risk for every job still waiting.
  8. Wake — the next time the cycle could decide differently even if nothing happens.
"""

from __future__ import annotations

from pydantic import TypeAdapter

from scheduler import admission, eta, health, ordering, quotas, staggering
from scheduler.admission import Admission
from scheduler.capacity import Capacity
from scheduler.coming_back import gpus_coming_back, promised_slots
from scheduler.forecast import ArrivalLoad
from scheduler.models import CycleResult, Pending, Placement, Priority, Reservation, RunningJob, Snapshot, gpu_path
from scheduler.preemptible import first_past


_LOWEST_RANK = max(priority.rank for priority in Priority)


def run_cycle(snapshot: Snapshot) -> CycleResult:
    now, config = snapshot.now, snapshot.config

    # 1. Health
    requeues = health.jobs_to_requeue(snapshot.machines, snapshot.running)
    lost = {r.job_id for r in requeues if not r.graceful}
    leaving = {r.job_id for r in requeues}
    running = [j for j in snapshot.running if j.spec.job_id not in lost] if lost else list(snapshot.running)
    gone = [j for j in snapshot.running if j.spec.job_id in lost] if lost else []

    # 2. Capacity — a lost job still holds its GPUs on the machines that answer: its allocation
    # ends only when its workflow has stopped it, so they are free from the next cycle on.
    cap = Capacity(snapshot.machines, snapshot.running)

    # 3. Quotas
    usage = quotas.team_usage(snapshot.quotas, running, snapshot.cluster)

    # 4. Order
    queue = ordering.ordered_queue(snapshot.queue, usage, snapshot.cluster)

    # 5. Admit
    state = admission.begin(snapshot, cap, usage, running, leaving, queue)
    admission.admit_queue(state, queue)

    # 6. Stagger
    placements = _with_checkpoint_phases(state.placed, running, now, config, snapshot.cluster)

    # 7. Estimate
    pending = _estimate(snapshot, state, gone)

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
        pending=pending,
        earmarks=tuple(state.earmarks.values()),
        next_wake=_next_wake(snapshot, state),
    )


def _with_checkpoint_phases(placed, running: list[RunningJob], now: float, config, cluster: str) -> list[Placement]:
    if not placed:  # most cycles place nothing: no write plan to make
        return []
    plan = None
    if config.stagger_checkpoints and any(q.spec.checkpoints for q, _, _ in placed):
        plan = staggering.running_plan(cluster, running, config.checkpoint_slot,
                                       [q.spec.checkpoint_interval for q, _, _ in placed if q.spec.checkpoints])
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


# Thousands of waiting jobs a cycle: validated as one list, not model by model (a third faster).
_PENDING = TypeAdapter(tuple[Pending, ...])


def _estimate(snapshot: Snapshot, state: Admission, gone: list[RunningJob]) -> tuple[Pending, ...]:
    if not state.waiting:
        return ()
    wanted = snapshot.estimate_only
    if not snapshot.estimate or wanted is not None and not any(job.spec.job_id in wanted for job, _ in state.waiting):
        # Nothing to estimate (the simulator asks only for the jobs that arrived, and those were
        # placed): the walk and its calendar would answer for nobody.
        wanted, starts = frozenset(), {}
    else:
        starts = _walk(snapshot, state, gone, wanted)
    out = []
    for position, (job, reason) in enumerate(state.waiting, start=1):  # appended in queue order
        start = starts.get(job.spec.job_id)
        deadline = job.spec.deadline
        misses = None
        if deadline is not None and (wanted is None or job.spec.job_id in wanted):
            misses = start is None or start + eta.remaining_work(job, snapshot.config.expected_restart_s) > deadline
        out.append({"job_id": job.spec.job_id, "position": position, "estimated_start": start,
                    "misses_deadline": misses, "reason": reason})
    return _PENDING.validate_python(out)


def _walk(snapshot: Snapshot, state: Admission, gone: list[RunningJob],
          wanted: frozenset[str] | None) -> dict[str, float]:
    """The estimate's walk from this cycle's decisions: estimated starts by job id.

    Earmarked GPUs are promised (coming_back.py): a claimant starts on its own as its victims
    leave them (the walk does not preempt, so it is answered there), and holds them for its
    expected run; a mover holds its new GPUs for the rest of its run."""
    now, config, cap = snapshot.now, snapshot.config, state.cap
    walked = cap.clone()
    promised = promised_slots(state.earmarks) if gone else {}
    for job in gone:  # the lost jobs' GPUs come back at once, for the estimate
        if promised and not promised.keys().isdisjoint(job.gpus):
            # A victim that lost a machine in its grace: its earmarked GPUs are the claimant's,
            # which the walk gives back when the claimant's run ends, not twice.
            walked.give([slot for slot in job.gpus if slot not in promised])
        else:
            walked.give_held(cap.masks_of(job))
    restart = config.expected_restart_s
    back, claimants = gpus_coming_back(state, admission.expected_ends(state))
    masks_of = cap.masks_of
    releases = (eta.Release(at, slots, job.spec.team, counted, machines, None if machines is None else masks_of(job))
                for at, job, slots, machines, counted in back)
    waiting = [job for job, _ in state.waiting if job.spec.job_id not in state.earmarks]
    starts = eta.estimate_starts(
        walked,
        releases,
        waiting,
        state.usage,
        now,
        starvation_threshold=config.starvation_threshold,
        max_holds=config.max_reservations,
        horizon=config.eta_horizon,
        keep_whole=state.keep_whole,
        wanted=wanted,
        arrivals=ArrivalLoad(snapshot.expected_arrivals, now, config.forecast_ramp),
        restart=restart,
        reservations=state.holds,
        rooms=[wait.hold(job_id, now) for job_id, wait in state.room_waits.items()],
        room_promises={job_id: (wait.team, wait.gpus) for job_id, wait in state.room_waits.items()},
    )
    if claimants:
        starts.update(claimants if wanted is None else {k: v for k, v in claimants.items() if k in wanted})
    return starts


def _next_wake(snapshot: Snapshot, state: Admission) -> float | None:
    """Only what could change a decision: a large job reaching the starvation threshold, a job
    reaching the consolidation wait with room to be made for it, a protection ending on a job
    that some waiting job would be allowed to displace, or a decision put off until a time."""
    if not state.waiting:
        return None
    now, config, cap, usage = snapshot.now, snapshot.config, state.cap, state.usage
    # One pass over the waiting jobs: large ones reaching the starvation threshold, the classes
    # waiting, and each team's smallest waiting job (a team reclaims if that one fits under its
    # guarantee: one question per team, not per job).
    times = list(state.wake_at)
    classes = set()
    smallest: dict[str, int] = {}
    fit_terms, threshold = cap.fit_terms, config.starvation_threshold
    moves, wait = config.max_consolidations > 0, config.consolidation_wait
    free_for: dict[tuple, int] = {}  # idle GPUs a job could use, per kind of machine it needs
    for job, _ in state.waiting:
        spec = job.spec
        n = spec.num_gpus
        if n >= fit_terms(spec)[1]:  # a whole machine of those it may use: it may starve (admission._starving)
            times.append(_past(job.queued_since, threshold))
        if moves and n > 1 and job.queued_since + wait > now:
            kind = (spec.kind, spec.gpu_type, spec.gpu_memory_gb)
            free = free_for.get(kind)
            if free is None:
                free = free_for[kind] = cap.total_free(cap.eligible_pools(spec))
            if free >= n:
                times.append(_past(job.queued_since, wait))  # idle GPUs enough, but scattered: a move may help
        classes.add(spec.priority)
        if n < smallest.get(spec.team, n + 1):
            smallest[spec.team] = n
    most_important = min(priority.rank for priority in classes)
    reclaiming = any(usage.under_guarantee_with(team, n) for team, n in smallest.items())
    borrowed = usage.borrowed if reclaiming else ()
    min_runtime, window, most = config.min_runtime, config.thrash_window, config.thrash_max_preemptions
    running = state.running
    if most_important == _LOWEST_RANK and not borrowed:
        # Only the lowest class waits (most cycles of an overloaded cluster) and no team reclaims:
        # nobody waiting may displace anyone, and of the running jobs only drains ending count.
        times.extend([job.draining_until for job in running if job.draining_until is not None])
        running = ()
    for job in running:
        if job.draining_until is not None:
            times.append(job.draining_until)
            continue
        if job.spec.priority.rank <= most_important and job.spec.job_id not in borrowed:
            continue  # nobody waiting may displace it, protected or not
        protected_until = _past(job.started_at, min_runtime)
        if protected_until > now:  # most ran longer long ago: only the future counts
            times.append(protected_until)
        if not job.preemptions:
            continue
        recent = sorted(t for t in job.preemptions if now - t <= window)
        if len(recent) >= most:
            times.append(recent[-most] + window + 1.0)
    future = [t for t in times if t > now]
    return min(future) if future else None


def _past(since: float, length: float) -> float:
    """When `length` has passed since `since` as the decisions ask it (t - since >= length):
    since + length, unless floats round that below."""
    t = since + length
    return t if t - since >= length else first_past(since, length, strictly=False)
