"""The policies gpusched is compared with, as cycle functions with the same signature.

Both use the same health handling and the same topology-aware placement as gpusched, so the
comparison isolates the policy: ordering, preemption, quotas and reservations.
  - fifo: strict submit order; the first job that does not fit blocks everyone behind it.
  - easy: EASY backfill — submit order; the first blocked job reserves the place it fits
    soonest, and later jobs start only where they do not delay it (by their expected runs, with
    the restart a resumed job needs, as gpusched's estimates have it). No preemption, no quotas.
"""

from __future__ import annotations

from scheduler import health, placement, reservation
from scheduler.capacity import Capacity
from scheduler.eta import remaining_work
from scheduler.expected_ends import end_of
from scheduler.models import CycleResult, Pending, Placement, Reservation, Snapshot


def _submit_order(snapshot: Snapshot):
    return sorted(snapshot.queue, key=lambda j: (j.submit_time, j.spec.job_id))


def _start(snapshot: Snapshot):
    requeues = health.jobs_to_requeue(snapshot.machines, snapshot.running)
    lost = {r.job_id for r in requeues if not r.graceful}
    running = [j for j in snapshot.running if j.spec.job_id not in lost]
    cap = Capacity(snapshot.machines, running)
    return requeues, running, cap


def fifo_cycle(snapshot: Snapshot) -> CycleResult:
    requeues, _, cap = _start(snapshot)
    placements, pending = [], []
    blocked_by = None
    for job in _submit_order(snapshot):
        slots = None if blocked_by else placement.find_gpus(cap, job.spec)
        if slots is None:
            reason = f"behind job {blocked_by} (strict FIFO)" if blocked_by else placement.explain_no_fit(cap, job.spec)
            blocked_by = blocked_by or job.spec.job_id
            pending.append(Pending(job_id=job.spec.job_id, position=len(pending) + 1, estimated_start=None,
                                   misses_deadline=None, reason=reason))
            continue
        cap.take(slots)
        placements.append(Placement(job_id=job.spec.job_id, gpus=slots, reason="fifo"))
    return CycleResult(placements=tuple(placements), requeues=tuple(requeues), pending=tuple(pending))


def easy_cycle(snapshot: Snapshot) -> CycleResult:
    requeues, running, cap = _start(snapshot)
    now = snapshot.now
    # The restart a resumed job needs before it works again, as gpusched's own estimates allow for
    # it: left out, a job backfilled as it resumed ran past the reservation it was to keep out of.
    restart = snapshot.config.expected_restart_s
    placements, pending = [], []
    placed_ends = []  # (expected end, (machine, GPU count)) of the jobs this cycle started
    hold = None
    for job in _submit_order(snapshot):
        avoid = placement.NO_AVOID
        if hold is not None and now + remaining_work(job, restart) > hold.expected_start:
            avoid = hold.machines
        slots = placement.find_gpus(cap, job.spec, avoid=avoid)
        if slots is None:
            reason = placement.explain_no_fit(cap, job.spec)
            if hold is None:
                # The jobs started ahead of it in this cycle give their GPUs back too: left out,
                # its reservation came later than it should, or not at all, and backfill delayed it.
                book = reservation.ReleaseBook([*((end_of(j, now, restart), cap.machines_of(j)) for j in running),
                                                *placed_ends])
                hold = reservation.plan_hold(cap, job.spec, book, now, frozenset())
            pending.append(Pending(job_id=job.spec.job_id, position=len(pending) + 1, estimated_start=None,
                                   misses_deadline=None, reason=reason))
            continue
        cap.take(slots)
        if hold is None:
            placed_ends.append((now + remaining_work(job, restart), cap.counts_of(slots)))
        placements.append(Placement(job_id=job.spec.job_id, gpus=slots, reason="easy",
                                    backfilled=hold is not None))
    reservations = ()
    if hold is not None:
        reservations = (Reservation(job_id=hold.job_id, machines=tuple(sorted(cap.machines[i].id for i in hold.machines)),
                                    expected_start=hold.expected_start),)
    return CycleResult(placements=tuple(placements), requeues=tuple(requeues), pending=tuple(pending),
                       reservations=reservations)
