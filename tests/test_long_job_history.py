"""A job that lives long goes on as a new run of its workflow between attempts, before its history
reaches Temporal's limits (51,200 events or 50 MB by default, past which the server terminates
the workflow: a lost job). Counts, pending signals and its class go with it.

Run on a Temporal dev server of the module's own, with the limits lowered so that a few dozen
attempts reach them, with the job's activities played by fakes, and once with a whole stack."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Replayer, Worker

from live.fakes import Launching
from live.jobs import Stack
from workers import servers as srv
from workflows.job import JobWorkflow
from workflows.types import (
    CarriedOver,
    EndReason,
    GpuGrant,
    HostGrant,
    JobOutcome,
    JobRequest,
    JobState,
    PlacementSignal,
    Priority,
    PriorityBump,
    PriorityChange,
    RunJobInput,
    RunJobResult,
    agent_task_queue,
    job_workflow_id,
)

# What the server suggests continuing as new at, and where it ends a workflow: a history of about
# twenty attempts of a one-machine job, or of a few of a gang with a large command.
LIMITS = {
    "limit.historyCount.suggestContinueAsNew": 100,
    "limit.historyCount.error": 500,
    "limit.historySize.suggestContinueAsNew": 1_500_000,
    "limit.historySize.error": 5_000_000,
}


@pytest.fixture(scope="module")
def low_limits_temporal(tmp_path_factory):
    server = srv.start_temporal(tmp_path_factory.mktemp("temporal-low-limits"), ui=False, dynamic_config=LIMITS)
    yield server.address
    server.stop()


class Attempts(Launching):
    """Each attempt's run, by its number: "fails" (the command exits 1) or "agent fails" (an
    infrastructure failure)."""

    def __init__(self, runs: list[str]):
        super().__init__()
        self.runs = runs

    @activity.defn(name="set_priority")
    async def set_priority(self, change: PriorityChange) -> bool:
        return True

    @activity.defn(name="run_job")
    async def run_job(self, run: RunJobInput) -> RunJobResult:
        if self.runs[run.attempt - 1] == "agent fails":
            raise ApplicationError("the agent broke", type="AgentBroke")
        return RunJobResult(exit_code=1, log_path="/dev/null", last_log_lines=["boom"])

    def activities(self) -> list:
        return [self.admit_job, self.wake_scheduler, self.start_attempt, self.set_priority, self.run_job,
                self.end_attempt]


@workflow.defn(name="JobWorkflow", sandboxed=False)
class BeforeContinuingAsNew(JobWorkflow):
    """The job's workflow as it was before it continued as new: it never asked."""

    @workflow.run
    async def run(self, raw: dict[str, Any], carried: CarriedOver | None = None) -> JobOutcome:
        return await super().run(raw, carried)

    def _history_long(self) -> bool:
        return False


async def live_a_long_life(address: str, runs: list[str], *, hosts: int = 1, spec_bytes: int = 0,
                           max_retries: int = 0, bump_after: int | None = None, bumping: bool = False,
                           old_code_for: int = 0):
    """A job sent a placement per entry of ``runs`` at once (the scheduler's cycles outrunning
    it), each on ``hosts`` machines, with a command and env of about ``spec_bytes`` each; its
    class raised to high once ``bump_after`` attempts have ended, or (``bumping``) changed
    between high and normal all along. Its first ``old_code_for`` attempts are run by a control
    worker of the code before it continued as new, the rest by one of today's. Returns the
    fakes, the job's last status, the number of runs its workflow had, its status, and the
    refusals the changes of class met."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    machine = f"m-{uuid.uuid4().hex[:8]}"
    fakes = Attempts(runs)
    control = "gpusched-control-" + machine
    refusals: list[str] = []

    def placement(attempt: int) -> PlacementSignal:
        return PlacementSignal(allocation_id=attempt, attempt=attempt, hosts=[
            HostGrant(machine_id=machine, gpus=[GpuGrant(index=i, path=f"{machine}/{i}")]) for i in range(hosts)])

    async def until_ended(attempts: int) -> None:
        for _ in range(1200):  # 60 s
            if len(fakes.ends) >= attempts or fakes.ends and fakes.ends[-1].next_state.terminal:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the job never ended ({len(fakes.ends)} attempts): {await handle.describe()}")

    async def bump_all_along() -> None:
        classes = [Priority.high, Priority.normal]
        while True:
            try:
                await handle.execute_update(JobWorkflow.bump_priority, PriorityBump(priority=classes[0]))
            except WorkflowUpdateFailedError as e:
                refusals.append(str(e.cause))
            except RPCError as e:  # the job has ended
                refusals.append(f"RPC: {e}")
            classes.reverse()
            await asyncio.sleep(0.02)

    async with Worker(client, task_queue=agent_task_queue(machine), activities=fakes.activities()):
        async with Worker(client, task_queue=control, activities=fakes.activities(),
                          workflows=[BeforeContinuingAsNew if old_code_for else JobWorkflow]) as worker:
            request = JobRequest(job_id=f"long-{machine}", team="vision", num_gpus=hosts, max_retries=max_retries,
                                 command=["train", "x" * spec_bytes], env={"BIG": "y" * spec_bytes})
            handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"), id=request.job_id,
                                                 task_queue=control, execution_timeout=timedelta(minutes=5))
            first = old_code_for or len(runs)
            for attempt in range(1, first + 1):
                # Pending ones are handed from run to run; those sent during a hand-over go to the next.
                await handle.signal(JobWorkflow.placement, placement(attempt))
            bumper = asyncio.create_task(bump_all_along()) if bumping else None
            if bump_after is not None:
                await until_ended(bump_after)
                await handle.execute_update(JobWorkflow.bump_priority, PriorityBump(priority=Priority.high))
            await until_ended(first)
            if old_code_for:
                await worker.shutdown()
                # Today's worker takes the run up where the old one left it, replaying its history.
                async with Worker(client, task_queue=control, workflows=[JobWorkflow], activities=fakes.activities()):
                    for attempt in range(old_code_for + 1, len(runs) + 1):
                        await handle.signal(JobWorkflow.placement, placement(attempt))
                    await until_ended(len(runs))
                    status, described = await ended(handle)
            else:
                status, described = await ended(handle)
        if bumper is not None:
            bumper.cancel()
        histories = await _histories_of(client, handle.id, described.run_id)
        replayer = Replayer(workflows=[JobWorkflow], data_converter=pydantic_data_converter)
        for history in histories:  # each run replays as it ran, the first and those handed on to
            await replayer.replay_workflow(history)
    return fakes, status, len(histories), described.status, refusals


async def ended(handle):
    """The job's last status and its workflow's description, once it has ended."""
    with contextlib.suppress(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), 30)
    return await handle.query(JobWorkflow.status), await handle.describe()


async def _histories_of(client: Client, workflow_id: str, last_run_id: str) -> list:
    """Each run's history, following each run's start back to the one before."""
    histories, run_id = [], last_run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        run_id = history.events[0].workflow_execution_started_event_attributes.continued_execution_run_id
    return histories[::-1]


@pytest.mark.live
def test_a_job_whose_history_was_long_before_the_upgrade_goes_on_in_new_runs_after_it(low_limits_temporal):
    """Twelve attempts under the code from before, past the point where the server suggests a new
    run; today's code replays them and goes on in new runs from the next attempt. Before, its
    replay answered the question 'no' at the loop tops where the old code never asked, and that
    answer held for the run: the job ran on to the server's limit."""
    fakes, status, runs_had, how, _ = asyncio.run(live_a_long_life(
        low_limits_temporal, ["fails"] * 30, max_retries=29, old_code_for=12))
    assert [e.allocation_id for e in fakes.ends] == list(range(1, 31))
    assert fakes.ends[-1].next_state is JobState.failed and "its 29 retries spent" in fakes.ends[-1].reason
    assert runs_had >= 3 and how.name == "FAILED" and status.attempts == 30


@pytest.mark.live
def test_changes_of_class_sent_all_along_are_never_refused_at_a_new_run(low_limits_temporal):
    """A class changed every 20 ms while the job goes through some twenty attempts and several
    runs: none is refused as if the job were not admitted (a new run's first task ran its
    handlers before it had taken over the job)."""
    fakes, status, runs_had, how, refusals = asyncio.run(live_a_long_life(
        low_limits_temporal, ["fails"] * 20, max_retries=19, bumping=True))
    assert runs_had >= 3 and status.attempts == 20
    assert [r for r in refusals if "admitted" in r] == []


@pytest.mark.live
def test_hundreds_of_events_of_attempts_go_on_in_new_runs_with_their_counts_and_signals(low_limits_temporal):
    """Thirty attempts, well past the lowered limit of 500 events: the job ends as it would in one
    run (its own failures retried, then four infrastructure failures in a row across runs, and the
    fifth fails it), every placement taken in turn, its class raised in one run kept in the next.
    Before, its one run was terminated by the server after the fifteenth attempt."""
    fakes, status, runs_had, how, _ = asyncio.run(live_a_long_life(
        low_limits_temporal, ["fails"] * 25 + ["agent fails"] * 5, max_retries=25, bump_after=10))
    assert [e.allocation_id for e in fakes.ends] == list(range(1, 31))
    assert [e.end_reason for e in fakes.ends] == [EndReason.failed] * 25 + [EndReason.machine_failure] * 5
    assert [e.failures_in_a_row for e in fakes.ends[25:]] == [1, 2, 3, 4, 0]
    assert fakes.ends[-1].next_state is JobState.failed and "5 infrastructure failures" in fakes.ends[-1].reason
    assert runs_had >= 3 and how.name == "FAILED"
    assert (status.state, status.attempts, status.priority) == (JobState.failed, 30, Priority.high)


@pytest.mark.live
def test_a_gang_with_a_large_command_goes_on_in_new_runs_before_its_history_is_too_big(low_limits_temporal):
    """Four machines, a command and env of 100 KiB each: about 800 kB of history per attempt;
    twelve attempts, the command failing each, end as the job's retries say, its own failures
    counted across runs. Before, its one run passed the lowered 5 MB limit at the sixth attempt
    and was terminated."""
    fakes, status, runs_had, how, _ = asyncio.run(live_a_long_life(
        low_limits_temporal, ["fails"] * 12, hosts=4, spec_bytes=100 * 1024, max_retries=11))
    assert [e.next_state for e in fakes.ends] == [JobState.queued] * 11 + [JobState.failed]
    assert "its 11 retries spent" in fakes.ends[-1].reason
    assert runs_had >= 3 and how.name == "FAILED" and status.attempts == 12


@pytest.mark.live
def test_a_job_on_a_whole_stack_retried_past_the_limits_ends_as_its_retries_say(live_stack, low_limits_temporal):
    """The control worker's real activities, the store and an agent: a command that fails at once,
    retried 24 times, goes through runs of its workflow and ends failed after its 25th attempt,
    every attempt in the store. Before, the server ended its workflow at the 16th attempt, and the
    store had it running."""
    s = Stack(live_stack(machines=1, gpus_per_machine=2, ui=False, control_args=["--tick", "0.5"],
                         settings={"temporal_address": low_limits_temporal}))
    try:
        s.submit("retried", 1, [sys.executable, "-c", "import sys; sys.exit(3)"], max_retries=24)
        view = s.wait("retried", timeout=240)
        assert (view.state, view.exit_code, len(view.attempts)) == ("failed", 3, 25), view
        assert "its 24 retries spent" in view.reason
        handle = s.client.temporal.get_workflow_handle(s.up.settings.task_queue_prefix + job_workflow_id("retried"))
        described = s.run(handle.describe())
        assert len(s.run(_histories_of(s.client.temporal, handle.id, described.run_id))) >= 2
    finally:
        s.close()
