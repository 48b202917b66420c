"""Changes of a job's class (`gpusched bump`) are taken one at a time, in the order they came: the
class the store schedules the job by is the class its workflow reports, however late the store's
writes are reported done. The job workflow runs on the real Temporal server, with its store
activities played by a fake that holds up the report of a write."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import warnings
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from live.fakes import Admitting
from scheduler.models import Priority
from workflows.job import JobWorkflow
from workflows.types import EndAttempt, JobOutcome, JobRequest, PriorityBump, PriorityChange

pytestmark = pytest.mark.live


class Store(Admitting):
    """The control plane's store activities, as the job workflow calls them: each change of class
    is written at once, and the report of the first one held up for `held_s`."""

    def __init__(self, held_s: float):
        self.held_s = held_s
        self.classes: list[str] = []  # the store's writes, in the order they happened

    @activity.defn(name="set_priority")
    async def set_priority(self, change: PriorityChange) -> bool:
        self.classes.append(change.priority.value)
        if len(self.classes) == 1:
            await asyncio.sleep(self.held_s)  # written, but its report is late (Temporal down, say)
        return True

    @activity.defn(name="end_attempt")
    async def end_attempt(self, end: EndAttempt) -> None:
        pass


@contextlib.asynccontextmanager
async def queued_job(address: str, store: Store):
    """A job workflow, admitted and queued, on a worker of its own with `store`'s activities."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    queue = f"bumps-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[JobWorkflow],
                      activities=[store.admit_job, store.wake_scheduler, store.set_priority, store.end_attempt]):
        request = JobRequest(job_id=f"bumped-{uuid.uuid4().hex[:6]}", team="vision", num_gpus=1,
                             command=["true"], priority="low")
        handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"),
                                             id=f"job-{request.job_id}", task_queue=queue,
                                             execution_timeout=timedelta(minutes=2))
        for _ in range(100):  # admitted: the validator takes changes of class from then on
            if (await handle.query(JobWorkflow.status)).cluster is not None:
                break
            await asyncio.sleep(0.05)
        yield handle


def change(handle, priority: Priority):
    return handle.start_update(JobWorkflow.bump_priority, PriorityBump(priority=priority),
                               wait_for_stage=WorkflowUpdateStage.ACCEPTED)


async def bumped_twice_at_once(address: str, first: Priority, second: Priority) -> tuple[list[str], JobOutcome]:
    """A queued job changed to `first` and, before that change is done, to `second`: the store's
    writes and what the workflow reports afterwards."""
    store = Store(held_s=2.0)
    async with queued_job(address, store) as handle:
        changes = [await change(handle, priority) for priority in (first, second)]
        await asyncio.gather(*(c.result() for c in changes))
        reported = await handle.query(JobWorkflow.status)
        await handle.signal(JobWorkflow.cancel, "the test is done")
        await handle.result()
    return store.classes, reported


@pytest.mark.parametrize("first, second", [
    (Priority.high, Priority.critical),
    (Priority.critical, Priority.normal),
], ids=["raised twice", "raised, then lowered"])
def test_two_changes_of_class_at_once_leave_the_last_one_asked_in_the_store_and_in_the_workflow(
        live_servers, first, second):
    classes, reported = asyncio.run(bumped_twice_at_once(live_servers.temporal_address, first, second))
    assert classes == [first.value, second.value], "written in the order asked, each after the one before was done"
    assert reported.priority == second


def test_a_change_of_class_still_being_made_as_its_job_ends_is_refused_and_leaves_no_warning(live_servers):
    async def scenario():
        async with queued_job(live_servers.temporal_address, Store(held_s=2.0)) as handle:
            pending = await change(handle, Priority.high)
            await handle.signal(JobWorkflow.cancel, "not needed any more")
            outcome = await handle.result()
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await pending.result()
            return outcome, refused.value

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome, refused = asyncio.run(scenario())
    assert outcome["state"] == "cancelled" and outcome["priority"] == "low"
    assert "completed before the Update completed" in str(refused.cause)
    # Abandoned on purpose: an ended job has no class to change, and its worker's log should not
    # say that work was cut short.
    assert not [w for w in caught if "update handlers are still running" in str(w.message)]
