"""A control worker's settings for its cluster's loop (the `configure` signal: --tick,
--cycles-per-run, --reconcile-every) hold from the next sleep on and are carried on by
continue-as-new, whenever during a cycle they come. The loop runs on the real Temporal server,
with its store activities played by a fake that holds its first cycle up."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from workflows.cluster import ClusterSchedulerWorkflow
from workflows.types import CycleInput, CycleOutcome, LoopSettings, Reconcile, SchedulerInput

pytestmark = pytest.mark.live


class Store:
    """The cycle's store activities: the first cycle waits until `go` is set."""

    def __init__(self):
        self.planning, self.go = asyncio.Event(), asyncio.Event()

    @activity.defn(name="plan_cycle")
    async def plan_cycle(self, inp: CycleInput) -> CycleOutcome:
        if not self.planning.is_set():
            self.planning.set()
            await self.go.wait()
        return CycleOutcome(cycle_seq=inp.cycle_seq, committed=True)

    @activity.defn(name="reconcile_allocations")
    async def reconcile_allocations(self, inp: Reconcile) -> int:
        return 0


async def configured_during_a_cycle(address: str, settings: LoopSettings) -> dict:
    """A loop of one cycle per run, sent `settings` while its cycle runs: the status of the run
    it continued as."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    queue, store = f"loop-{uuid.uuid4().hex[:8]}", Store()
    async with Worker(client, task_queue=queue, workflows=[ClusterSchedulerWorkflow],
                      activities=[store.plan_cycle, store.reconcile_allocations]):
        handle = await client.start_workflow(
            "ClusterSchedulerWorkflow", SchedulerInput(cluster="c1", tick_seconds=30.0, cycles_per_run=1),
            id=f"scheduler-{queue}", task_queue=queue)
        await asyncio.wait_for(store.planning.wait(), 10)
        await handle.signal(ClusterSchedulerWorkflow.configure, settings)
        store.go.set()
        try:
            for _ in range(200):
                if (await handle.describe()).run_id != handle.first_execution_run_id:
                    return await client.get_workflow_handle(handle.id).query(ClusterSchedulerWorkflow.status)
                await asyncio.sleep(0.05)
            raise AssertionError("the loop did not continue as new")
        finally:
            await client.get_workflow_handle(handle.id).terminate("the test is done")


def test_settings_sent_while_a_cycle_runs_are_carried_on_by_continue_as_new(live_servers):
    """The loop took its input for the iteration before the cycle and continued as new with it:
    settings that came during the cycle were dropped until another control worker started."""
    settings = LoopSettings(tick_seconds=0.5, cycles_per_run=7, reconcile_seconds=90.0)
    status = asyncio.run(configured_during_a_cycle(live_servers.temporal_address, settings))
    assert (status["tick_seconds"], status["cycles_per_run"]) == (0.5, 7)


@pytest.mark.parametrize("flag, value", [("--tick", "0"), ("--cycles-per-run", "0"), ("--reconcile-every", "-1")])
def test_a_control_worker_refuses_loop_settings_no_loop_can_run_with_before_it_starts(capsys, flag, value):
    """Before, it migrated the database and then failed with a traceback from the loop's model."""
    from workers.control import main

    with pytest.raises(SystemExit) as refused:
        main([flag, value])
    assert refused.value.code == 2
    assert flag in capsys.readouterr().err
