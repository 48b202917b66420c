"""A stop asked while a job's watch is lost and the control plane cannot yet tell whether it heard
the machine (Temporal, the API and Postgres all back from an outage): the process is stopped with
the stop's grace, as any stop, not left to its agent to kill as an orphan with a few seconds."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.worker import Worker
from temporalio.contrib.pydantic import pydantic_data_converter

from live.fakes import Launching
from workflows.job import JobWorkflow
from workflows.types import (
    UNSURE,
    AttachOrder,
    AttemptStopping,
    EndReason,
    GpuGrant,
    HearingAsk,
    HostGrant,
    JobRequest,
    JobState,
    PlacementSignal,
    PreemptSignal,
    RunJobInput,
    RunJobResult,
    StopOrder,
    agent_task_queue,
)


class LostWatch(Launching):
    """An attempt whose watch stops heartbeating (Temporal lost its heartbeats) while the process
    runs on; the control plane unsure whether it heard the machine; the agent stopping the
    process when told to, and the watch attached again seeing it end stopped."""

    def __init__(self):
        super().__init__()
        self.unsure_asked = asyncio.Event()
        self.stops: list[StopOrder] = []
        self.attached: list[AttachOrder] = []

    @activity.defn(name="run_job")
    async def run_job(self, run: RunJobInput) -> RunJobResult:
        await asyncio.sleep(3600)  # no heartbeat: the watch times out on the server's side
        raise AssertionError("unreachable")

    @activity.defn(name="machines_heard")
    async def machines_heard(self, ask: HearingAsk) -> list[str]:
        self.unsure_asked.set()
        return [UNSURE for _ in ask.machine_ids]

    @activity.defn(name="stop_job")
    async def stop_job(self, order: StopOrder) -> None:
        self.stops.append(order)

    @activity.defn(name="attach_job")
    async def attach_job(self, order: AttachOrder) -> RunJobResult:
        self.attached.append(order)
        return RunJobResult(exit_code=None, signal=15, stopped=True, log_path="/dev/null")

    def activities(self) -> list:
        return [self.admit_job, self.wake_scheduler, self.start_attempt, self.set_job_state, self.run_job,
                self.machines_heard, self.stop_job, self.attach_job, self.mark_attempt_stopping, self.end_attempt]


class StoreDownForTheMark(LostWatch):
    """And Postgres down as a cancel marks its attempt stopping, until `store_back`; whether the
    process had been told to stop meanwhile in `stopped_while_down`."""

    def __init__(self):
        super().__init__()
        self.store_back = asyncio.Event()
        self.stopped_while_down = False

    @activity.defn(name="mark_attempt_stopping")
    async def mark_attempt_stopping(self, stopping: AttemptStopping) -> None:
        if not self.store_back.is_set():
            raise RuntimeError("the database does not answer")
        self.marks.append(stopping)


async def stop_during_the_wait(address: str, stop: str, fakes: LostWatch | None = None) -> LostWatch:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    machine = f"m-{uuid.uuid4().hex[:8]}"
    fakes = fakes or LostWatch()
    async with Worker(client, task_queue="gpusched-control-" + machine, workflows=[JobWorkflow],
                      activities=fakes.activities()), \
            Worker(client, task_queue=agent_task_queue(machine), activities=fakes.activities()):
        request = JobRequest(job_id=f"unsure-{machine}", team="vision", num_gpus=1, command=["true"])
        handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"), id=request.job_id,
                                             task_queue="gpusched-control-" + machine,
                                             execution_timeout=timedelta(minutes=2))
        await handle.signal(JobWorkflow.placement, PlacementSignal(
            allocation_id=1, attempt=1, grace_period=30,
            hosts=[HostGrant(machine_id=machine, gpus=[GpuGrant(index=0, path=f"{machine}/0")])]))
        # The watch times out after AGENT_HEARTBEAT (10 s); the hearing wait then lasts up to 30 s.
        await asyncio.wait_for(fakes.unsure_asked.wait(), 40)
        await asyncio.sleep(1)
        if stop == "preempt":
            await handle.signal(JobWorkflow.preempt, PreemptSignal(allocation_id=1, grace_period=120,
                                                                   reason="a more important job"))
        else:
            await handle.signal(JobWorkflow.cancel, "not wanted any more")
        if isinstance(fakes, StoreDownForTheMark):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_until(lambda: fakes.stops), 5)
            fakes.stopped_while_down = bool(fakes.stops)
            fakes.store_back.set()
        for _ in range(400):
            if fakes.ends:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the attempt never ended")
        if not fakes.ends[-1].next_state.terminal:
            await handle.signal(JobWorkflow.cancel, "the test is done")
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 30)
    return fakes


async def _until(what) -> None:
    while not what():
        await asyncio.sleep(0.05)


@pytest.mark.live
def test_a_cancel_stops_the_process_of_a_lost_watch_while_the_store_cannot_mark_its_attempt(live_servers):
    """The mark (status's "stopping: …") waited for Postgres before the stop was sent: the
    process ran on past its grace, or was killed by its agent as an orphan."""
    fakes = asyncio.run(stop_during_the_wait(live_servers.temporal_address, "cancel", StoreDownForTheMark()))
    assert fakes.stopped_while_down
    assert [m.reason for m in fakes.marks] == ["not wanted any more"]
    assert [(e.end_reason, e.next_state) for e in fakes.ends[:1]] == [(EndReason.cancelled, JobState.cancelled)]


@pytest.mark.live
@pytest.mark.parametrize("name, stop, grace, end, next_state", [
    ("a preemption stops the process with its own grace and requeues the job as preempted",
     "preempt", 120, EndReason.preempted, JobState.queued),
    ("a cancel stops the process with the attempt's grace and cancels the job",
     "cancel", 30, EndReason.cancelled, JobState.cancelled),
])
def test_a_stop_during_the_hearing_wait_is_a_stop_with_its_grace(live_servers, name, stop, grace, end, next_state):
    fakes = asyncio.run(stop_during_the_wait(live_servers.temporal_address, stop))
    assert [(s.allocation_id, s.grace_period) for s in fakes.stops] == [(1, grace)]
    assert [a.allocation_id for a in fakes.attached] == [1]  # watched until it ended, then the GPUs freed
    assert [(e.end_reason, e.next_state) for e in fakes.ends[:1]] == [(end, next_state)]
