"""Fair share by quota: what each team holds, what it may still take, and what it has borrowed.

A team's *guarantee* is capacity it can always get back; above it, a team *borrows* idle GPUs up
to its *maximum*. Borrowed GPUs are the first to be reclaimed when a team under its guarantee
has pending work. Which of a team's jobs are the borrowed ones is decided by start time: the
most recently started jobs beyond the guarantee, since they lose the least when reclaimed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Mapping, Sequence

from scheduler.models import Quota, RunningJob
from scheduler.since_last_cycle import PerCluster, RunningChanges

NO_QUOTA = Quota()
_JOB_ID = attrgetter("spec.job_id")
_STARTED_AT = attrgetter("started_at")


def quota_of(quotas: Mapping[str, Quota], team: str) -> Quota | None:
    """The team's own quota, else the ``"*"`` default every team not named has; None: no quota."""
    return quotas.get(team) or quotas.get("*")


@dataclass
class TeamUsage:
    quotas: Mapping[str, Quota]
    running: Sequence[RunningJob] = ()
    used: dict[str, int] = field(default_factory=dict)
    # GPUs earmarked for a team's waiting jobs (preemption victims or movers still leaving them):
    # the team is about to hold them, so they count towards its guarantee.
    promised: dict[str, int] = field(default_factory=dict)
    preemptible: Callable[[RunningJob], bool] = lambda job: True  # set by the cycle
    start_order: "StartOrder | None" = None  # of `running`: who is borrowed, in which order
    _borrowed: set[str] | None = None

    def quota(self, team: str) -> Quota:
        # quota_of's lookup, written out: the cycle asks this thousands of times.
        return self.quotas.get(team) or self.quotas.get("*") or NO_QUOTA

    def held(self, team: str) -> int:
        return self.used.get(team, 0)

    def within_max(self, team: str, gpus: int) -> bool:
        """Whether the team stays within its maximum taking `gpus` more, beyond what it holds and
        what is promised to its waiting jobs (GPUs they are about to take count already)."""
        limit = self.quota(team).max
        return limit is None or self.held(team) + self.promised.get(team, 0) + gpus <= limit

    def under_guarantee_with(self, team: str, gpus: int) -> bool:
        """Whether the team would still be within its guarantee after taking `gpus` more, beyond
        what it holds and what is promised to its waiting jobs."""
        return self.held(team) + self.promised.get(team, 0) + gpus <= self.quota(team).guaranteed

    def promise(self, team: str, gpus: int) -> None:
        """`gpus` earmarked for one of the team's waiting jobs (negative: the job took them up)."""
        self.promised[team] = self.promised.get(team, 0) + gpus

    def share(self, team: str) -> float:
        """Held over guaranteed: below 1 the team is owed capacity; the queue favours the lowest."""
        guaranteed = self.quota(team).guaranteed
        if guaranteed == 0:
            return float("inf")
        return self.held(team) / guaranteed

    def add(self, team: str, gpus: int) -> None:
        self.used[team] = self.used.get(team, 0) + gpus

    @property
    def borrowed(self) -> set[str]:
        """Job ids of the running jobs above their team's guarantee (worked out when first asked)."""
        if self._borrowed is None:
            if self.start_order is None:
                self.start_order = StartOrder(self.running)
            self._borrowed = _borrowed_jobs(self, self.start_order)
        return self._borrowed


def team_usage(quotas: Mapping[str, Quota], running: Sequence[RunningJob], cluster: str | None = None) -> TeamUsage:
    """What each team holds; with `cluster`, the teams' start order is kept for the cluster's
    next cycle and brought up to date from the jobs that started or ended since."""
    if cluster is None:
        order = StartOrder(running)
    else:
        if not isinstance(running, (list, tuple)):
            running = tuple(running)
        with _kept.lock:
            order = _kept.get(cluster, lambda kept: kept.update(running), lambda: StartOrder(running)).copy()
    # What teams hold grows as admission places jobs; the order stays as the running jobs left it.
    return TeamUsage(quotas, running, dict(order.used), start_order=order)


def _start_key(job: RunningJob) -> tuple[float, str]:
    return -job.started_at, job.spec.job_id


class StartOrder:
    """Per team, its running jobs most recently started first, then by id (the order in which
    borrowed jobs are picked), and the GPUs each team holds. Kept from cycle to cycle per
    cluster (scheduler/since_last_cycle.py): a cycle inserts the few jobs that started and takes
    out those that ended, instead of grouping and sorting every running job again."""

    def __init__(self, running: Sequence[RunningJob]):
        self.changes = RunningChanges(running)
        self.used: dict[str, int] = {}
        self.by_team: dict[str, list[RunningJob]] = {}
        for job in running:
            spec = job.spec
            self.used[spec.team] = self.used.get(spec.team, 0) + spec.num_gpus
            self.by_team.setdefault(spec.team, []).append(job)
        for jobs in self.by_team.values():
            # Two sorts on plain keys (the second keeps the first's order among equal starts),
            # cheaper than one on a built key.
            jobs.sort(key=_JOB_ID)
            jobs.sort(key=_STARTED_AT, reverse=True)

    def update(self, running: Sequence[RunningJob]) -> bool:
        """Follow the jobs that started and ended since; False when too many did (build anew)."""
        changes = self.changes.since(running)
        if changes is None:
            return False
        ended, started = changes
        for job in ended:
            team = job.spec.team
            jobs = self.by_team[team]
            k = bisect_left(jobs, _start_key(job), key=_start_key)
            while jobs[k] is not job:
                k += 1
            del jobs[k]
            self.used[team] -= job.spec.num_gpus
            if not jobs:
                del self.by_team[team], self.used[team]
        for job in started:
            team = job.spec.team
            insort(self.by_team.setdefault(team, []), job, key=_start_key)
            self.used[team] = self.used.get(team, 0) + job.spec.num_gpus
        return True

    def copy(self) -> "StartOrder":
        """This order as it is now, for one cycle to read while the kept one follows the next."""
        twin = object.__new__(StartOrder)
        twin.used = dict(self.used)
        twin.by_team = {team: list(jobs) for team, jobs in self.by_team.items()}
        return twin


_kept: PerCluster[StartOrder] = PerCluster()


def _borrowed_jobs(usage: TeamUsage, order: StartOrder) -> set[str]:
    borrowed = set()
    for team, jobs in order.by_team.items():
        over = order.used[team] - usage.quota(team).guaranteed
        if over <= 0:
            continue
        # First the jobs that can be given back now and fit in what the team holds beyond its
        # guarantee (reclaimed, they leave it at its guarantee, not below: it would reclaim in
        # turn); then the rest. Each group most recently started first. Whether a job is
        # preemptible is asked only of the jobs looked at: most of a team's jobs never are.
        rest = []
        for job in jobs:
            if over <= 0:
                break
            if job.spec.num_gpus <= over and usage.preemptible(job):
                borrowed.add(job.spec.job_id)
                over -= job.spec.num_gpus
            else:
                rest.append(job)
        for job in rest:
            if over <= 0:
                break
            borrowed.add(job.spec.job_id)
            over -= job.spec.num_gpus
    return borrowed


def admission_refusal(team: str, queued: int, quotas: Mapping[str, Quota], num_gpus: int) -> str | None:
    """Why a new job of `team` asking for `num_gpus` must be refused at submit, naming the
    request's field at fault as the never-fits reasons do, or None to accept it. A job bigger
    than its team's maximum could never start: it is refused, as live admission does, instead of
    waiting for ever."""
    quota = quota_of(quotas, team)
    if quota is None:
        return f"{no_quota_refusal(team)} (field team)"
    if quota.max is not None and num_gpus > quota.max:
        return f"{over_max_refusal(team, num_gpus, quota.max)} (field num_gpus)"
    if quota.queue_cap is not None and queued >= quota.queue_cap:
        return f"{queue_cap_refusal(team, queued, quota.queue_cap)} (field team)"
    return None


def no_quota_refusal(team: str) -> str:
    """Why a job of a team with no quota (and no "*" default) is refused, in live admission's
    words and the simulator's."""
    return (f"team '{team}' has no quota (and there is no '*' default); an operator sets one with "
            f"`gpusched quota set {team} --guaranteed N --max M --queue-cap Q`")


def over_max_refusal(team: str, num_gpus: int, most: int) -> str:
    """Why a job bigger than its team's maximum is refused, in live admission's words and the
    simulator's."""
    return (f"the job asks for {num_gpus} GPUs but team '{team}' may hold at most {most}; "
            "ask for fewer or raise the team's max")


def queue_cap_refusal(team: str, waiting: int, cap: int) -> str:
    """Why a job of a team with `waiting` jobs waiting is refused under its queue cap, in live
    admission's words and the simulator's."""
    if cap == 0:
        return f"team '{team}' has a queue cap of 0: none of its jobs may wait; raise the cap to submit"
    return f"team '{team}' already has {waiting} jobs waiting, its queue cap; wait for some to start or raise the cap"
