"""A cycle's orders reach the jobs whatever their number: the loop signals them in chunks, as
Temporal takes at most 2,000 signals in flight from one workflow. On the real Temporal server,
with the store's activities played by a fake."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from workflows.cluster import ClusterSchedulerWorkflow
from workflows.types import (Abandoned, CycleInput, CycleOutcome, GpuGrant, HostGrant, PlacementOrder,
                             PlacementSignal, Reconcile, SchedulerInput)

pytestmark = pytest.mark.live

ORDERS = 2_001  # one more than Temporal takes in flight


class Store:
    """The first cycle orders ORDERS placements, of jobs whose workflows do not exist (so each
    is abandoned: what the loop does with an order it could not deliver); later cycles none."""

    def __init__(self):
        self.cycles, self.abandoned = 0, []

    @activity.defn(name="plan_cycle")
    async def plan_cycle(self, inp: CycleInput) -> CycleOutcome:
        self.cycles += 1
        grant = [HostGrant(machine_id="c1/b0/r0/m0", gpus=[GpuGrant(index=0, path="c1/b0/r0/m0/0")])]
        orders = [PlacementOrder(job_id=f"j{i}", signal=PlacementSignal(allocation_id=i + 1, attempt=1, hosts=grant))
                  for i in range(ORDERS)] if self.cycles == 1 else []
        return CycleOutcome(cycle_seq=inp.cycle_seq, committed=True, placements=orders)

    @activity.defn(name="abandon_allocations")
    async def abandon_allocations(self, gone: list[Abandoned]) -> None:
        self.abandoned += [a.allocation_id for a in gone]

    @activity.defn(name="reconcile_allocations")
    async def reconcile_allocations(self, inp: Reconcile) -> int:
        return 0


async def a_cycle_of_many_orders(address: str) -> Store:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    queue, store = f"orders-{uuid.uuid4().hex[:8]}", Store()
    async with Worker(client, task_queue=queue, workflows=[ClusterSchedulerWorkflow],
                      activities=[store.plan_cycle, store.abandon_allocations, store.reconcile_allocations]):
        # Its first task turns 2,001 orders into signals: on a slow, loaded host that took over
        # the default 10 s a task may take, and the task timed out on every try.
        handle = await client.start_workflow(
            "ClusterSchedulerWorkflow", SchedulerInput(cluster="c1", tick_seconds=0.2),
            id=f"scheduler-{queue}", task_queue=queue, task_timeout=timedelta(seconds=60))
        try:
            deadline = time.monotonic() + 120
            while store.cycles < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        finally:
            await handle.terminate("the test is done")
    return store


def test_a_cycle_of_more_orders_than_temporal_takes_at_once_delivers_them_and_the_loop_goes_on(live_servers):
    """Before, the cycle's task failed on every retry ("PendingSignalsLimitExceeded"), no cycle
    came after it, and its placements held their GPUs unacknowledged."""
    # Bounded: once, on such a host, the worker's shutdown after the terminate never ended, and
    # the suite with it.
    store = asyncio.run(asyncio.wait_for(a_cycle_of_many_orders(live_servers.temporal_address), 300))
    assert store.cycles >= 2
    assert sorted(store.abandoned) == list(range(1, ORDERS + 1))  # each order was tried, and answered
