"""Queue order: who is considered first. Always a total order, so every cycle agrees with itself.

  1. priority class (critical first),
  2. how far the team is below its guarantee (held / guaranteed, lowest first),
  3. deadline hint (earliest first; none last),
  4. submit time (a requeued job keeps its place),
  5. job id.

Consecutive cycles often see the very same queue (the live store and the simulator hand back the
same job objects while nothing about them changed) with the same teams' shares: the order is then
the last cycle's, kept per cluster (scheduler/since_last_cycle.py), instead of thousands of jobs
sorted again into the same order.
"""

from __future__ import annotations

from operator import is_
from typing import Sequence

from scheduler.models import QueuedJob
from scheduler.quotas import TeamUsage
from scheduler.since_last_cycle import PerCluster

NO_DEADLINE = float("inf")


def ordered_queue(queue: Sequence[QueuedJob], usage: TeamUsage, cluster: str = "") -> list[QueuedJob]:
    """The queue in the order above; the cluster's last order when neither the jobs (by
    identity) nor their teams' shares changed since."""
    with _kept.lock:
        kept = _kept.get(cluster, lambda kept: kept.holds_for(queue, usage), lambda: _Order(queue, usage))
        return list(kept.order)


class _Order:
    """A queue's order, with what it was worked out from."""

    def __init__(self, queue: Sequence[QueuedJob], usage: TeamUsage):
        # Holding the jobs keeps their ids from being reused by new ones.
        self.queue = tuple(queue)
        # Each team's share worked out once (thousands of jobs, a handful of teams), and the keys
        # built in one loop rather than by a call per job.
        self.shares = {team: usage.share(team) for team in {job.spec.team for job in self.queue}}
        shares = self.shares
        keyed = []
        for place, job in enumerate(self.queue):
            spec = job.spec
            deadline = spec.deadline if spec.deadline is not None else NO_DEADLINE
            # The place last: equal keys (never, job ids being unique) keep their order, as in a stable sort.
            keyed.append((spec.priority.rank, shares[spec.team], deadline, job.submit_time, spec.job_id, place))
        keyed.sort()
        self.order = [self.queue[key[-1]] for key in keyed]

    def holds_for(self, queue: Sequence[QueuedJob], usage: TeamUsage) -> bool:
        """Whether this is the order of `queue` too: the same jobs, in the same places, and the
        same shares for their teams."""
        last = self.queue
        return (len(last) == len(queue) and all(map(is_, last, queue))
                and all(usage.share(team) == share for team, share in self.shares.items()))


_kept: PerCluster[_Order] = PerCluster()
