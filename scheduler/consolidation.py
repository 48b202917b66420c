"""Consolidation: move a few small jobs so a waiting gang job gets one machine.

Jobs end at random, so the free GPUs of a busy fleet end up scattered: three here, two there,
none of them enough for a job that needs four GPUs on one machine, while nothing waiting is
small enough to use them. The gang job waits and the pieces sit idle. Preemption does not help
when nobody waiting outranks the jobs in the way. A *move* does: a job that can checkpoint is
stopped with the usual grace period and restarts at once, from that checkpoint, on GPUs that
were idle elsewhere; the gang job takes the machine it left.

The policy, in the order it is applied:
  1. Only for a job that needs 2 or more GPUs on one machine, cannot start on free GPUs, may not
     displace anyone (or found nobody to displace), and has waited `consolidation_wait`.
  2. Who may be moved: a running job held on that one machine alone, that can checkpoint, is
     not protected from preemption (minimum runtime, thrash protection), and is of the waiting
     job's class or lower: a move never interrupts more important work for less important.
  3. Where: the machine that needs the fewest GPUs moved, then the least work at risk, then the
     lowest number. Movers are taken lowest class first, then least work at risk.
  4. Only if it works: every mover must fit *now* on free GPUs of other machines (bin-packed
     like any placement, never on machines held for a reservation). Those GPUs are earmarked
     for the mover, as the gang job's are for it, so nobody takes them while it checkpoints.
  5. A move counts as a preemption: the mover's thrash protection and the preemption figures
     include it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler import placement
from scheduler.preemption import placement_without
from scheduler.capacity import NO_RESERVE, Capacity, KeepWhole, Layout, grouped
from scheduler.models import GpuSlot, JobSpec, RunningJob, Topology
from scheduler.since_last_cycle import PerJob


@dataclass(frozen=True)
class Move:
    job: RunningJob
    to: tuple[GpuSlot, ...]  # where it restarts, taken out of the capacity already


@dataclass(frozen=True)
class Consolidation:
    gpus: tuple[GpuSlot, ...]  # where the gang job starts once the movers have left
    moves: tuple[Move, ...]


def domain_kind(cap: Capacity, claimant: JobSpec) -> Topology | None:
    """Where a gang job's GPUs must all be: one machine or one block; None if anywhere will do
    (then scattered free GPUs serve it as they are) or it is not a gang."""
    pools, _, topology = cap.fit_terms(claimant)
    if claimant.num_gpus < 2 or not pools:
        return None
    if topology == Topology.machine or topology == Topology.block:
        return topology
    return None


def movable_by_domain(cap: Capacity, kind: Topology, exposed: Sequence[RunningJob]) -> dict[object, list[RunningJob]]:
    """Unprotected running jobs that could move, by the one machine (or block) holding them."""
    out: dict[object, list[RunningJob]] = {}
    which = 0 if kind == Topology.machine else 1
    layout = cap.layout
    domains_of = _domains.get
    for job in exposed:
        domain = domains_of(job, layout)[which]
        if domain is not None:
            found = out.get(domain)
            if found is None:
                out[domain] = [job]
            else:
                found.append(job)
    return out


def _domains_of(job: RunningJob, layout: Layout) -> tuple[int | None, str | None]:
    """(machine, block) holding all of a job that can checkpoint, or None where it spans more
    than one, has no checkpoints, or is partly on a machine that is down (health requeues it)."""
    if not job.spec.checkpoint_interval:  # JobSpec.checkpoints, without a call per job
        return None, None
    counts = grouped(layout, job).counts
    if len(counts) == 1:  # most jobs: one machine, so one domain of any kind
        (i, count), = counts
        return (i, layout.block_of[i]) if count == job.spec.num_gpus else (None, None)
    if sum(count for _, count in counts) != job.spec.num_gpus:
        return None, None
    blocks = {layout.block_of[i] for i, _ in counts}
    return None, (blocks.pop() if len(blocks) == 1 else None)


# Where a running job could be moved from, worked out once per job object and layout.
_domains: PerJob[tuple[int | None, str | None]] = PerJob(_domains_of)


def plan_move(
    cap: Capacity,
    claimant: JobSpec,
    kind: Topology,
    movable: dict[object, list[RunningJob]],
    now: float,
    avoid: frozenset[int],
    going: set[str],
    keep_whole: KeepWhole = NO_RESERVE,
    max_tries: int = 8,
    reserved: frozenset[int] = frozenset(),
) -> Consolidation | None:
    """Which jobs to move where so `claimant` can start; takes the GPUs they move to out of
    `cap`. None (and `cap` as it was) if no machine or block can be cleared that way. `avoid`:
    machines held for reservations the claimant would run past; `reserved`: every machine held
    for a reservation, where no mover lands (a mover runs on, past any reservation's start)."""
    pools = cap.eligible_pools(claimant)
    n = claimant.num_gpus
    free, pool_of = cap.free, cap.pool_of
    members: dict[object, list[int]] = {}
    if kind == Topology.machine:  # a domain is its one machine: only those holding movable jobs
        for i in movable:
            if pool_of[i] in pools:
                members[i] = [i]
    else:
        for i, domain in enumerate(cap.domains(kind)):
            if domain in movable and pool_of[i] in pools:
                members.setdefault(domain, []).append(i)
    rank = claimant.priority.rank
    options = []
    for domain, machines in members.items():
        if not avoid.isdisjoint(machines):
            continue  # held for a reservation: not ours to clear
        # Loops, not generators: a busy fleet has a few hundred machines to look at, each time.
        need = n
        for i in machines:
            need -= len(free[i])
        if need <= 0:
            continue  # it fits already, but the reserved pool keeps it whole
        eligible, total = [], 0
        for job in movable[domain]:
            spec = job.spec
            if spec.priority.rank >= rank and spec.job_id not in going:
                eligible.append(job)
                total += spec.num_gpus
        if total < need:
            continue  # all of them would not be enough, in any order
        movers, gained = [], 0
        for job in sorted(eligible, key=lambda j: (-j.spec.priority.rank, j.work_at_risk(now), j.spec.job_id)):
            if gained >= need:
                break
            movers.append(job)
            gained += job.spec.num_gpus
        if gained >= need:
            options.append((need, len(movers), sum(j.work_at_risk(now) for j in movers), domain, machines, movers))
    options.sort(key=lambda o: o[:4])
    if kind == Topology.machine:
        # A mover that took a whole free machine would only trade places with the claimant,
        # which would have fitted there (unless the machine is kept whole): pieces only.
        whole = frozenset(i for p in cap.pools.values() for i in p.buckets[p.key.gpus])
        landing_avoid = avoid | reserved | whole
    else:
        landing_avoid = avoid | reserved
    for *_, machines, movers in options[:max_tries]:
        found = _try(cap, claimant, frozenset(machines), movers, avoid, landing_avoid, keep_whole)
        if found is not None:
            return found
    return None


def _try(cap: Capacity, claimant: JobSpec, domain: frozenset[int], movers: list[RunningJob],
         avoid: frozenset[int], landing_avoid: frozenset[int], keep_whole: KeepWhole) -> Consolidation | None:
    """Place the movers outside the domain, then the claimant in it; undo all if either fails."""
    moves: list[Move] = []
    elsewhere = landing_avoid | domain
    for job in movers:
        to = placement.find_gpus(cap, job.spec, avoid=elsewhere, keep_whole=keep_whole)
        if to is None:
            break
        cap.take(to)
        moves.append(Move(job, to))
    else:
        outside = frozenset(range(len(cap.machines))) - domain
        gpus = placement_without(cap, claimant, movers, avoid | outside, keep_whole)
        if gpus is not None:
            used = set(gpus)
            kept = []
            for move in moves:
                if any(slot in used for slot in move.job.gpus):
                    kept.append(move)
                else:
                    cap.give(move.to)  # the placement did not need this one to leave
            return Consolidation(gpus, tuple(kept))
    for move in moves:
        cap.give(move.to)
    return None


def move_reason(claimant: JobSpec, move: Move) -> str:
    where = ", ".join(sorted({machine for machine, _ in move.to}))
    return (f"moved to make room for job {claimant.job_id} ({claimant.num_gpus} GPUs that must share a "
            f"machine or block): checkpoints and restarts at once on {where}")
