"""How many infrastructure failures in a row a job has met: five fail it, but a long attempt
between two failures starts the count again (a three-day job meets a machine's death now and
then with nothing wrong with it), and an attempt that ends otherwise ends the row."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from live.fakes import Launching
from workflows.job import INFRA_STREAK_RESET, MAX_INFRA_FAILURES, JobWorkflow, infra_failures_with
from workflows.types import (
    EndAttempt,
    EndReason,
    GpuGrant,
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


@pytest.mark.parametrize("name, before, ran_for, after", [
    ("an attempt its agent never picked up adds one", 2, None, 3),
    ("an attempt that died within seconds adds one", 0, timedelta(seconds=20), 1),
    ("an attempt that ran just under the reset adds one", 4, INFRA_STREAK_RESET - timedelta(seconds=1),
     MAX_INFRA_FAILURES),
    ("an attempt that ran the reset or longer starts the count again", 4, INFRA_STREAK_RESET, 1),
    ("a day-long attempt lost to its machine is the first in a row", 3, timedelta(days=1), 1),
])
def test_infrastructure_failures_in_a_row(name, before, ran_for, after):
    assert infra_failures_with(before, ran_for) == after


# --- in the job workflow, on the real Temporal server with its activities played by fakes ------


class Attempts(Launching):
    """The store and agent activities a job's attempts meet: each attempt's run fails as an
    agent's would (an infrastructure failure) or runs until it is stopped (a preemption)."""

    def __init__(self, runs: list[str]):
        super().__init__()
        self.runs = runs  # per attempt: "agent fails", "command fails" (exit 3: the job's own), "runs" or "moved"
        self.started = asyncio.Event()  # an attempt that runs is under way

    @activity.defn(name="stop_job")
    async def stop_job(self, order: StopOrder) -> None:
        pass

    @activity.defn(name="run_job")
    async def run_job(self, run: RunJobInput) -> RunJobResult:
        if self.runs[run.attempt - 1] == "agent fails":
            raise ApplicationError("the agent broke", type="AgentBroke")
        if self.runs[run.attempt - 1] == "command fails":
            return RunJobResult(exit_code=3, log_path="/dev/null")
        self.started.set()
        while True:  # until cancelled (stopped), heartbeating as an agent does
            activity.heartbeat()
            await asyncio.sleep(0.2)

    def activities(self) -> list:
        return [self.admit_job, self.wake_scheduler, self.start_attempt, self.set_job_state, self.stop_job,
                self.run_job, self.mark_attempt_stopping, self.end_attempt]


async def attempts_of(address: str, runs: list[str], max_retries: int = 0, moved_after: float = 0.0,
                      fakes: Attempts | None = None, **worker) -> list[EndAttempt]:
    """A job placed once per entry of `runs`, each ended as that entry says: the ends recorded.
    "moved" runs `moved_after` seconds and is then moved off by the cycle (a drain, a sick GPU),
    with a grace; "moved at once", with none (a gang that lost a machine)."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    machine = f"m-{uuid.uuid4().hex[:8]}"
    fakes = fakes if fakes is not None else Attempts(runs)
    async with Worker(client, task_queue="gpusched-control-" + machine, workflows=[JobWorkflow],
                      activities=fakes.activities(), **worker), \
            Worker(client, task_queue=agent_task_queue(machine), activities=fakes.activities()):
        request = JobRequest(job_id=f"streak-{machine}", team="vision", num_gpus=1, command=["true"],
                             max_retries=max_retries)
        handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"), id=request.job_id,
                                             task_queue="gpusched-control-" + machine,
                                             execution_timeout=timedelta(minutes=2))
        for attempt, how in enumerate(runs, start=1):
            fakes.started.clear()
            await handle.signal(JobWorkflow.placement, PlacementSignal(
                allocation_id=attempt, attempt=attempt,
                hosts=[HostGrant(machine_id=machine, gpus=[GpuGrant(index=0, path=f"{machine}/0")])]))
            if how == "runs":
                await asyncio.wait_for(fakes.started.wait(), 30)
                await handle.signal(JobWorkflow.preempt, PreemptSignal(allocation_id=attempt, grace_period=1,
                                                                       reason="a more important job"))
            elif how.startswith("moved"):
                await asyncio.wait_for(fakes.started.wait(), 30)
                await asyncio.sleep(moved_after)
                await handle.signal(JobWorkflow.preempt, PreemptSignal(
                    allocation_id=attempt, grace_period=0 if how == "moved at once" else 1,
                    reason=f"machine {machine} is being drained", end_reason=EndReason.machine_failure))
            for _ in range(600):  # 30 s: a workflow task that fails leaves the attempt unended
                if len(fakes.ends) >= attempt:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"attempt {attempt} never ended")
            if fakes.ends[-1].next_state.terminal:
                break
        else:
            await handle.signal(JobWorkflow.cancel, "the test is done")
        with contextlib.suppress(WorkflowFailureError):
            await handle.result()
    return fakes.ends


@pytest.mark.live
def test_a_preemption_between_infrastructure_failures_ends_their_row(live_servers):
    """One failure, a long run preempted, then four more: four in a row, the job queued again.
    Before, the count went on across the preemption, and the fifth failed the job."""
    ends = asyncio.run(attempts_of(live_servers.temporal_address, ["agent fails", "runs"] + ["agent fails"] * 4))
    assert [e.end_reason for e in ends] == [EndReason.machine_failure, EndReason.preempted] + [
        EndReason.machine_failure] * 4 + [EndReason.cancelled]
    assert [e.next_state for e in ends[:-1]] == [JobState.queued] * 6
    assert [e.failures_in_a_row for e in ends[:-1]] == [1, 0, 1, 2, 3, 4]


@pytest.mark.live
def test_the_jobs_own_failure_retried_between_infrastructure_failures_ends_their_row(live_servers):
    """One failure of the agent's, the command's own failure (retried), then four more of the
    agent's: four in a row, the job queued again, not failed for five."""
    runs = ["agent fails", "command fails"] + ["agent fails"] * 4
    ends = asyncio.run(attempts_of(live_servers.temporal_address, runs, max_retries=1))
    assert [e.end_reason for e in ends] == [EndReason.machine_failure, EndReason.failed] + [
        EndReason.machine_failure] * 4 + [EndReason.cancelled]
    assert [e.next_state for e in ends[:-1]] == [JobState.queued] * 6
    assert [e.failures_in_a_row for e in ends[:-1]] == [1, 0, 1, 2, 3, 4]


@pytest.mark.live
@pytest.mark.parametrize("moved_after, in_a_row, last", [
    (16.0, [1, 2, 3, 4, 0, 1], JobState.queued),
    (0.0, [1, 2, 3, 4, 0, 0], JobState.failed),  # a move is not counted, nor a job's last failure
], ids=["a move off a drained machine after a long run ends the row",
        "a move after a short run leaves the row as it was"])
def test_a_job_moved_off_its_machine_after_a_long_run_starts_its_count_again(live_servers, monkeypatch, moved_after,
                                                                             in_a_row, last):
    """Four failures, a run moved off by a drain, one more failure. A failure after a long run
    starts the count again; a drain after one kept the row, and the next failure was the fifth.
    (The reset is 20 s here, not 30 min, the workflow unsandboxed to take it; a move takes about
    8 s with these fakes.)"""
    monkeypatch.setattr("workflows.job.INFRA_STREAK_RESET", timedelta(seconds=20))
    runs = ["agent fails"] * 4 + ["moved", "agent fails"]
    ends = asyncio.run(attempts_of(live_servers.temporal_address, runs, moved_after=moved_after,
                                   workflow_runner=UnsandboxedWorkflowRunner()))
    assert [e.end_reason for e in ends[:6]] == [EndReason.machine_failure] * 6
    assert [e.failures_in_a_row for e in ends[:6]] == in_a_row
    assert ends[5].next_state is last
    assert ("(5 infrastructure failures)" in ends[5].reason) is (last is JobState.failed)


@pytest.mark.live
@pytest.mark.parametrize("how, states", [
    ("runs", ["checkpointing"]),
    ("moved", ["checkpointing"]),
    ("moved at once", []),
], ids=["a preempted job checkpoints in its grace",
        "so does a job moved off a drained machine or a sick GPU (before, it showed running)",
        "a job stopped without a grace does not"])
def test_a_job_told_to_stop_with_a_grace_shows_checkpointing(live_servers, how, states):
    fakes = Attempts([how, "runs"])
    asyncio.run(attempts_of(live_servers.temporal_address, [how], fakes=fakes))
    assert fakes.states == states


class AttemptsThatCheckpointWhenStopped(Attempts):
    """Each attempt runs until stopped, then takes a while (its grace) to checkpoint and exit."""

    def __init__(self, runs: list[str]):
        super().__init__(runs)
        self.stopping = asyncio.Event()

    @activity.defn(name="run_job")
    async def run_job(self, run: RunJobInput) -> RunJobResult:
        self.started.set()
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self.stopping.set()
            await asyncio.sleep(1.5)  # checkpointing in the grace
            raise


@pytest.mark.live
def test_a_job_cancelled_while_it_checkpoints_for_a_preemption_ends_cancelled_not_queued_again(live_servers):
    """The user's cancel, arriving in the preemption's grace, is the job's end: requeued, the
    job would run again after its user cancelled it."""
    async def scenario() -> list[EndAttempt]:
        client = await Client.connect(live_servers.temporal_address, data_converter=pydantic_data_converter)
        machine = f"m-{uuid.uuid4().hex[:8]}"
        fakes = AttemptsThatCheckpointWhenStopped(["runs"])
        async with Worker(client, task_queue="gpusched-control-" + machine, workflows=[JobWorkflow],
                          activities=fakes.activities()), \
                Worker(client, task_queue=agent_task_queue(machine), activities=fakes.activities()):
            request = JobRequest(job_id=f"cancel-{machine}", team="vision", num_gpus=1, command=["true"])
            handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"), id=request.job_id,
                                                 task_queue="gpusched-control-" + machine,
                                                 execution_timeout=timedelta(minutes=2))
            await handle.signal(JobWorkflow.placement, PlacementSignal(
                allocation_id=1, attempt=1,
                hosts=[HostGrant(machine_id=machine, gpus=[GpuGrant(index=0, path=f"{machine}/0")])]))
            await asyncio.wait_for(fakes.started.wait(), 30)
            await handle.signal(JobWorkflow.preempt, PreemptSignal(allocation_id=1, grace_period=5,
                                                                   reason="a more important job"))
            await asyncio.wait_for(fakes.stopping.wait(), 30)
            await handle.signal(JobWorkflow.cancel, "not needed any more")
            with contextlib.suppress(WorkflowFailureError):
                await asyncio.wait_for(handle.result(), 30)
        return fakes.ends

    ends = asyncio.run(scenario())
    assert [(e.end_reason, e.next_state) for e in ends] == [(EndReason.cancelled, JobState.cancelled)]
