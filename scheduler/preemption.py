"""Preemption: who is displaced, and why. The policy, in the order it is applied:

  1. Only for a job that cannot start on free GPUs, and only within its team's maximum.
  2. Who may be displaced: a job of a *lower* priority class; or, when the waiting job's team is
     still within its guarantee (counting the waiting job), a *borrowed* job of another team
     (reclaim), whatever its class.
  3. Who is protected: a job that has run less than the minimum runtime; a job preempted
     `thrash_max_preemptions` times within the last `thrash_window` (thrash protection); and a
     job that cannot checkpoint once it has run `max_unsaved_run`, since all of it would be lost.
  4. Victim order: lowest class first; borrowed before guaranteed; most recently started first;
     then the one with the least work since its last checkpoint; then job id.
  5. Whole gangs only, and only if it works: for each place the job could go (a machine, a
     block, or the cluster, by its topology) take victims in victim order until enough GPUs
     would be free there; keep the place whose worst victim is the most displaceable (then the
     least work at risk, then the fewest victims), and check with a real placement that the freed
     GPUs let the job start, topology included. Otherwise nobody is displaced.
  6. Victims get the grace period to checkpoint and exit before their GPUs are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.capacity import Capacity
from scheduler.models import JobSpec, PolicyConfig, RunningJob, Topology
from scheduler.placement import find_gpus, resolved_topology
from scheduler.quotas import TeamUsage


@dataclass(frozen=True)
class VictimChoice:
    victims: tuple[RunningJob, ...]
    gpus: tuple  # where the job will start once they have left


def protection(job: RunningJob, now: float, config: PolicyConfig) -> str | None:
    """Why this running job may not be preempted now, or None."""
    if now - job.started_at < config.min_runtime:
        return "has run less than the minimum runtime"
    recent = [t for t in job.preemptions if now - t < config.thrash_window]
    if len(recent) >= config.thrash_max_preemptions:
        return f"was preempted {len(recent)} times in the last {config.thrash_window / 60:g} minutes"
    if not job.spec.checkpoints and now - job.started_at > config.max_unsaved_run:
        return "cannot checkpoint and has run too long to throw away"
    return None


def victim_key(job: RunningJob, now: float, usage: TeamUsage) -> tuple:
    """Smaller sorts first: the job to displace before any other."""
    spec = job.spec
    borrowed = 0 if spec.job_id in usage.borrowed else 1
    return (-spec.priority.rank, borrowed, -job.started_at, job.work_at_risk(now), spec.job_id)


def displaceable(
    claimant: JobSpec, running: Sequence[RunningJob], now: float, config: PolicyConfig, usage: TeamUsage
) -> list[RunningJob]:
    reclaim = usage.under_guarantee_with(claimant.team, claimant.num_gpus)
    out = []
    for job in running:
        if job.draining:
            continue
        lower = job.spec.priority.rank > claimant.priority.rank
        borrowed = reclaim and job.spec.team != claimant.team and job.spec.job_id in usage.borrowed
        if (lower or borrowed) and protection(job, now, config) is None:
            out.append(job)
    return out


def choose_victims(
    cap: Capacity,
    claimant: JobSpec,
    candidates: Sequence[RunningJob],
    now: float,
    usage: TeamUsage,
) -> VictimChoice | None:
    pools = cap.eligible_pools(claimant)
    if not pools or not candidates:
        return None
    eligible = {i for p in pools for i in p.members}
    topology = resolved_topology(cap, claimant, pools)
    domain_of = _domain_function(cap, topology, claimant.num_gpus, pools)

    # What each candidate would free in each domain (only the eligible machines count).
    freed: dict[str, dict[str, int]] = {}
    for job in candidates:
        for machine_id, _ in job.gpus:
            i = cap.index.get(machine_id)
            if i is None or i not in eligible:
                continue
            per = freed.setdefault(domain_of(i), {})
            per[job.spec.job_id] = per.get(job.spec.job_id, 0) + 1
    if not freed:
        return None
    free_in: dict[str, int] = {}
    for i in eligible:
        free_in[domain_of(i)] = free_in.get(domain_of(i), 0) + len(cap.free[i])

    by_id = {job.spec.job_id: job for job in candidates}
    keys = {job_id: victim_key(job, now, usage) for job_id, job in by_id.items()}
    n = claimant.num_gpus
    options = []
    for domain, gains in freed.items():
        have = free_in.get(domain, 0)
        taken = []
        for job_id in sorted(gains, key=keys.__getitem__):
            taken.append(job_id)
            have += gains[job_id]
            if have >= n:
                break
        if have >= n:
            at_risk = sum(by_id[j].work_at_risk(now) for j in taken)
            options.append(((max(keys[j] for j in taken), at_risk, len(taken)), taken))
    for _, taken in sorted(options, key=lambda o: o[0]):
        victims = tuple(by_id[j] for j in taken)
        gpus = _placement_without(cap, claimant, victims)
        if gpus is not None:
            return VictimChoice(victims, gpus)
    return None


def _domain_function(cap: Capacity, topology: Topology, n: int, pools):
    if topology == Topology.machine:
        return lambda i: cap.machines[i].id
    if topology == Topology.block:
        return lambda i: cap.machines[i].block
    largest = max(p.key.gpus for p in pools)
    if n <= largest:
        return lambda i: cap.machines[i].id
    return lambda i: "cluster"


def _placement_without(cap: Capacity, claimant: JobSpec, victims: Sequence[RunningJob]):
    """Simulate the victims gone, try the real placement, and undo."""
    slots = [slot for v in victims for slot in v.gpus if slot[0] in cap.index]
    slots = [s for s in slots if s[1] not in cap.free[cap.index[s[0]]]]
    cap.give(slots)
    try:
        return find_gpus(cap, claimant)
    finally:
        cap.take([s for s in slots if s[1] in cap.free[cap.index[s[0]]]])


def displacement_reason(claimant: JobSpec, victim: RunningJob) -> str:
    spec = victim.spec
    if spec.priority.rank > claimant.priority.rank:
        return f"{claimant.priority.value} job {claimant.job_id} needs its GPUs; {spec.priority.value} yields"
    return f"team {claimant.team} reclaims capacity team {spec.team} borrowed, for job {claimant.job_id}"
