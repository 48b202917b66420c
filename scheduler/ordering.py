"""Queue order: who is considered first. Always a total order, so every cycle agrees with itself.

  1. priority class (critical first),
  2. how far the team is below its guarantee (held / guaranteed, lowest first),
  3. deadline hint (earliest first; none last),
  4. submit time (a requeued job keeps its place),
  5. job id.
"""

from __future__ import annotations

from typing import Sequence

from scheduler.models import QueuedJob
from scheduler.quotas import TeamUsage

NO_DEADLINE = float("inf")


def queue_key(job: QueuedJob, usage: TeamUsage) -> tuple:
    spec = job.spec
    deadline = spec.deadline if spec.deadline is not None else NO_DEADLINE
    return (spec.priority.rank, usage.share(spec.team), deadline, job.submit_time, spec.job_id)


def ordered_queue(queue: Sequence[QueuedJob], usage: TeamUsage) -> list[QueuedJob]:
    # queue_key, with each team's share worked out once: thousands of jobs, a handful of teams.
    shares: dict[str, float] = {}

    def key(job: QueuedJob) -> tuple:
        spec = job.spec
        share = shares.get(spec.team)
        if share is None:
            share = shares[spec.team] = usage.share(spec.team)
        deadline = spec.deadline if spec.deadline is not None else NO_DEADLINE
        return (spec.priority.rank, share, deadline, job.submit_time, spec.job_id)

    return sorted(queue, key=key)
