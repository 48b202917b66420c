"""The plan-cycle activity: snapshot → the pure core → commit, in one Postgres transaction."""

from __future__ import annotations

from temporalio import activity

from activities.store import CycleConflict, Store
from scheduler.cycle import run_cycle
from workflows.types import CycleInput, CycleOutcome

# A cycle that meets a concurrent change (a job cancelled while it read, say) reads again; past
# this many tries the activity fails and Temporal retries it with backoff.
CONFLICT_RETRIES = 5


class PlanningActivities:
    def __init__(self, store: Store):
        self.store = store

    @activity.defn(name="plan_cycle")
    async def plan_cycle(self, inp: CycleInput) -> CycleOutcome:
        for attempt in range(CONFLICT_RETRIES):
            try:
                # The store holds the collector off from its read to its commit (gc_policy.py).
                return await self.store.plan_cycle(inp.cluster, inp.cycle_seq, run_cycle)
            except CycleConflict:
                if attempt == CONFLICT_RETRIES - 1:
                    raise
                activity.logger.info("cycle %s of %s met a concurrent change; reading again",
                                     inp.cycle_seq, inp.cluster)
        raise AssertionError("unreachable")
