"""Preemption: who is displaced, and why. The policy, in the order it is applied:

  1. Only for a job that cannot start on free GPUs, and only within its team's maximum.
  2. Who may be displaced: a job of a *lower* priority class (when the waiting job would borrow,
     only one that is borrowed itself or of the waiting job's own team); or, when the waiting
     job's team is still within its guarantee (counting the waiting job), a *borrowed* job of
     another team (reclaim), whatever its class.
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
from typing import Callable, Collection, Sequence

from scheduler import in_words
from scheduler.capacity import NO_RESERVE, Capacity, KeepWhole
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
    if job.preemptions:  # most jobs never were: skip building the list
        recent = [t for t in job.preemptions if now - t <= config.thrash_window]
        if len(recent) >= config.thrash_max_preemptions:
            return f"was preempted {len(recent)} times in the last {config.thrash_window / 60:g} minutes"
    if not job.spec.checkpoints and now - job.started_at > config.max_unsaved_run:
        return "cannot checkpoint and has run too long to throw away"
    return None


def protected_until(job: RunningJob, now: float, config: PolicyConfig) -> float | None:
    """When a protected job's protections have all ended (None: one of them does not end by
    itself); `now` for a job that is not protected."""
    ends = [now]
    if now - job.started_at < config.min_runtime:
        ends.append(job.started_at + config.min_runtime)
    if job.preemptions:
        recent = sorted(t for t in job.preemptions if now - t <= config.thrash_window)
        if len(recent) >= config.thrash_max_preemptions:
            # protected until the oldest of its last `thrash_max_preemptions` leaves the window
            ends.append(recent[-config.thrash_max_preemptions] + config.thrash_window)
    if not job.spec.checkpoints and now - job.started_at > config.max_unsaved_run:
        return None
    return max(ends)


def protected_jobs(running: Sequence[RunningJob], preemptible: Callable[[RunningJob], bool], now: float,
                   config: PolicyConfig) -> list[tuple[RunningJob, float | None]]:
    """The running jobs protection keeps from every claimant, with when that ends (`protected_until`)."""
    return [(j, protected_until(j, now, config)) for j in running if j.draining_until is None and not preemptible(j)]


def protected_below(claimant: JobSpec, protected: Sequence[tuple[RunningJob, float | None]], usage: TeamUsage,
                    now: float) -> str | None:
    """For a claimant that found no job to displace: the jobs of `protected` (`protected_jobs`)
    that only protection keeps from it, in words, or None if there are none. As in
    `displaceable`: a job of a lower class (of its own team or of a team over its guarantee when
    the claimant would borrow), or, when the claimant reclaims, any job of another team over its
    guarantee."""
    rank, team = claimant.priority.rank, claimant.team
    reclaim = usage.under_guarantee_with(team, claimant.num_gpus)

    def over(other: str) -> bool:
        return other != team and usage.held(other) > usage.quota(other).guaranteed

    ends = []
    for j, until in protected:
        lower = j.spec.priority.rank > rank
        if (lower or over(j.spec.team)) if reclaim else (lower and (j.spec.team == team or over(j.spec.team))):
            ends.append(until)
    if not ends:
        return None
    ending = [t for t in ends if t is not None]
    if len(ends) == 1:
        said = "1 job it could displace is protected from preemption"
        return said if not ending else f"{said} for {in_words.duration(ending[0] - now)} more"
    said = f"{len(ends)} jobs it could displace are protected from preemption"
    return said if not ending else f"{said}, the first for {in_words.duration(min(ending) - now)} more"


def victim_key(job: RunningJob, now: float, usage: TeamUsage) -> tuple:
    """Smaller sorts first: the job to displace before any other."""
    spec = job.spec
    borrowed = 0 if spec.job_id in usage.borrowed else 1
    return (-spec.priority.rank, borrowed, -job.started_at, job.work_at_risk(now), spec.job_id)


class Exposed:
    """The running jobs that some claimant could displace (not draining, not protected), in the
    order given; and, asked for by class, those below a class. Each list is found when first
    asked for and kept for the cycle; protection is asked only of the jobs a list could hold."""

    def __init__(self, running: Sequence[RunningJob], preemptible: Callable[[RunningJob], bool],
                 unprotected: Callable[[], list[RunningJob]] | None = None):
        """`unprotected`, if given, finds `jobs` at once (preemptible.ExposedNow.unprotected)."""
        self.running, self.preemptible, self._unprotected = running, preemptible, unprotected
        self._jobs: list[RunningJob] | None = None
        self._below: dict[int, list[RunningJob]] = {}

    @property
    def jobs(self) -> list[RunningJob]:
        if self._jobs is None:
            if self._unprotected is not None:
                self._jobs = self._unprotected()
            else:
                preemptible = self.preemptible
                # draining_until rather than the `draining` property: this is asked of every running job
                self._jobs = [j for j in self.running if j.draining_until is None and preemptible(j)]
        return self._jobs

    def below(self, rank: int) -> list[RunningJob]:
        """Those of a class less important than `rank`. Remembered: most claimants are of the
        lowest classes, for whom this is a short list or none, and a cycle asks many times.
        Taken from a list that holds them all (the same jobs in the same order, without asking
        protection again): one already found, or every unprotected job when those are found at
        once; else from the running jobs."""
        found = self._below.get(rank)
        if found is None:
            wider = self._jobs
            for other, jobs in self._below.items():
                if other < rank and (wider is None or len(jobs) < len(wider)):
                    wider = jobs
            if wider is None and self._unprotected is not None:
                wider = self.jobs  # all at once is cheaper than asking of each job
            if wider is not None:
                found = [j for j in wider if j.spec.priority.rank > rank]
            else:
                preemptible = self.preemptible
                found = [j for j in self.running
                         if j.spec.priority.rank > rank and j.draining_until is None and preemptible(j)]
            self._below[rank] = found
        return found


def displaceable(claimant: JobSpec, exposed: Exposed, usage: TeamUsage) -> list[RunningJob]:
    """Of the unprotected jobs, those this claimant may displace (a lower class, or reclaim)."""
    rank = claimant.priority.rank
    borrowed, team = usage.borrowed, claimant.team
    if usage.under_guarantee_with(team, claimant.num_gpus):
        return [
            j for j in exposed.jobs
            if j.spec.priority.rank > rank or (j.spec.team != team and j.spec.job_id in borrowed)
        ]
    # A job that would borrow takes nothing from another team's guarantee: that team would
    # reclaim it at once, and the two would take turns preempting each other.
    return [j for j in exposed.below(rank) if j.spec.team == team or j.spec.job_id in borrowed]


def in_victim_order(candidates: Sequence[RunningJob], now: float, usage: TeamUsage,
                    key_cache: dict[str, tuple]) -> list[tuple[tuple, RunningJob]]:
    """The candidates with their victim keys, the first to displace first; `key_cache` lives
    for one cycle (what the keys depend on does not change within it)."""
    ranked = []
    for job in candidates:
        key = key_cache.get(job.spec.job_id)
        if key is None:
            key = key_cache[job.spec.job_id] = victim_key(job, now, usage)
        ranked.append((key, job))
    ranked.sort(key=lambda pair: pair[0])
    return ranked


def choose_victims(
    cap: Capacity,
    claimant: JobSpec,
    ranked: Sequence[tuple[tuple, RunningJob]],
    avoid: frozenset[int] = frozenset(),
    leaving: Collection[str] = frozenset(),
) -> VictimChoice | None:
    """The victims to displace for `claimant`, or None. `ranked` is the candidates in victim
    order (`in_victim_order`); those in `leaving` (already told to go this cycle) are passed over."""
    pools = cap.eligible_pools(claimant)
    if not pools or not ranked:
        return None
    topology = resolved_topology(cap, claimant)
    scope = _scope(topology, claimant.num_gpus, pools)
    choice = _search(cap, claimant, ranked, avoid, leaving, pools, scope)
    if choice is None and scope != topology:
        # A job that may go anywhere is first given room on one machine; failing that, room
        # made across machines still lets it start.
        choice = _search(cap, claimant, ranked, avoid, leaving, pools, topology)
    return choice


def _search(cap: Capacity, claimant: JobSpec, ranked: Sequence[tuple[tuple, RunningJob]], avoid: frozenset[int],
            leaving: Collection[str], pools, scope: Topology) -> VictimChoice | None:
    """`choose_victims` within places of one kind: machines, blocks, or the whole cluster."""
    pool_of = cap.pool_of
    domain_of = cap.domains(scope)

    free_in: dict[object, int] = {}
    for pool in pools:
        for count in range(1, pool.key.gpus + 1):  # only machines with a free GPU add anything
            for i in pool.buckets[count]:
                if i not in avoid:
                    domain = domain_of[i]
                    free_in[domain] = free_in.get(domain, 0) + count

    # Candidates are taken in victim order, each adding what it frees in each domain (only the
    # eligible machines count). A domain becomes an option at the candidate that makes enough
    # room there, its worst victim; options of a later candidate are worse, so those of one
    # candidate are checked (least work at risk, then fewest victims, then the domain met first)
    # before the next candidate is looked at, and the search stops at the first that works.
    n = claimant.num_gpus
    have: dict[object, int] = {}
    taken: dict[object, list[tuple[tuple, RunningJob]]] = {}
    met: dict[object, int] = {}  # domain -> when first met: the last tie-break
    for key, job in ranked:
        if job.spec.job_id in leaving:
            continue
        gains: dict[object, int] = {}
        for i, count in cap.machines_of(job):
            if i not in avoid and pool_of[i] in pools:
                domain = domain_of[i]
                gains[domain] = gains.get(domain, 0) + count
        options = []
        for domain, count in gains.items():
            listed = taken.get(domain)
            if listed is None:
                met[domain] = len(met)
                listed = taken[domain] = []
                have[domain] = free_in.get(domain, 0)
            elif have[domain] >= n:
                continue  # an option already, at an earlier candidate
            listed.append((key, job))
            have[domain] += count
            if have[domain] >= n:
                # key[3] is the work at risk
                options.append((sum(k[3] for k, _ in listed), len(listed), met[domain], listed))
        for *_, pairs in sorted(options):
            victims = tuple(job for _, job in pairs)
            gpus = placement_without(cap, claimant, victims, avoid)
            if gpus is not None:
                # The real placement may not need every victim counted for the place: spare the rest.
                used = set(gpus)
                needed = tuple(v for v in victims if any(slot in used for slot in v.gpus))
                return VictimChoice(needed, gpus)
    return None


def _scope(topology: Topology, n: int, pools) -> Topology:
    """Where room is looked for first: where the job's GPUs must all be (one machine, one
    block), and for one that may go anywhere, one machine when it fits on one."""
    largest = max(p.key.gpus for p in pools)
    if topology == Topology.machine or (topology == Topology.any and n <= largest):
        return Topology.machine
    return topology


def placement_without(cap: Capacity, claimant: JobSpec, victims: Sequence[RunningJob], avoid: frozenset[int],
                      keep_whole: KeepWhole = NO_RESERVE):
    """Simulate the victims gone, try the real placement, and undo."""
    slots = [slot for v in victims for slot in v.gpus if slot[0] in cap.index]
    slots = [s for s in slots if s[1] not in cap.free[cap.index[s[0]]]]
    cap.give(slots)
    try:
        return find_gpus(cap, claimant, avoid=avoid, keep_whole=keep_whole)
    finally:
        cap.take([s for s in slots if s[1] in cap.free[cap.index[s[0]]]])


def displacement_reason(claimant: JobSpec, victim: RunningJob) -> str:
    spec = victim.spec
    if spec.priority.rank > claimant.priority.rank:
        return f"{claimant.priority.value} job {claimant.job_id} needs its GPUs; {spec.priority.value} yields"
    return f"team {claimant.team} reclaims capacity team {spec.team} borrowed, for job {claimant.job_id}"
