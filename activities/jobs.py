"""The control-side activities of a job's life: admission, attempts, state, priority, and waking
its cluster's scheduler. Each is one store call (or one Temporal call), idempotent."""

from __future__ import annotations

import asyncio
import re
import time

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import WorkflowExecutionStatus as Status
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionRequest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.checkpoints import (
    CheckpointStoreUnavailable,
    checkpoint_uri,
    object_uri,
    sweep_ended_job,
    verify_object,
)
from activities.store import Store
from workflows.types import (
    CONTROL_TASK_QUEUE,
    SCHEDULER_WORKFLOW,
    Abandoned,
    Admission,
    AttemptGrant,
    AttemptStopping,
    EndReason,
    JobState,
    EndAttempt,
    HearingAsk,
    JobRequest,
    JobStateChange,
    LoopSettings,
    PriorityChange,
    Reconcile,
    SchedulerInput,
    StartAttempt,
    UnusableReport,
    Wake,
    job_workflow_id,
    scheduler_workflow_id,
)


STORE_LOOK_S = 20.0  # the longest the control plane looks for a checkpoint in its store (HEAD, retries)

# The statuses of a workflow that has ended, read from the server's raw answer: the SDK's enum
# lacks the newer ones (PAUSED: alive, only held), and one it cannot decode must not stop a
# cluster's loop nor count a living job as gone.
ENDED = frozenset({Status.WORKFLOW_EXECUTION_STATUS_COMPLETED, Status.WORKFLOW_EXECUTION_STATUS_FAILED,
                   Status.WORKFLOW_EXECUTION_STATUS_CANCELED, Status.WORKFLOW_EXECUTION_STATUS_TERMINATED,
                   Status.WORKFLOW_EXECUTION_STATUS_TIMED_OUT})
# A cluster name that goes into a visibility query as it is (others are left out of the query:
# the store's queue of the cluster narrows the answer all the same).
_QUOTABLE = re.compile(r"[A-Za-z0-9._-]+")


class JobActivities:
    def __init__(self, store: Store, client: Client, task_queue_prefix: str = "",
                 loop: SchedulerInput | None = None, bucket: str = "gpusched-checkpoints", s3=None):
        self.store = store
        self.bucket = bucket
        self.s3 = s3  # a boto3 client of the checkpoint store; None: a machine's word is taken as said
        self.client = client
        self.prefix = task_queue_prefix
        self.loop = loop or SchedulerInput(cluster="")
        self._sweeps: set[asyncio.Task] = set()  # references, so the tasks are not collected

    @activity.defn(name="admit_job")
    async def admit_job(self, request: JobRequest) -> Admission:
        expected = self.prefix + job_workflow_id(request.job_id)
        started_as = activity.info().workflow_id
        if started_as != expected:
            # Placements, preemptions and cancels go to the workflow of that id: one started
            # under another would wait for ever while its job was placed to nobody.
            return Admission(accepted=False, job_id=request.job_id, field="job_id", task_queue_prefix=self.prefix,
                             reason=f"the job's workflow must have the id '{expected}', not '{started_as}'; "
                                    "start it under that id (or submit with `gpusched submit`)")
        admission = await self.store.admit(request)
        return admission.model_copy(update={"task_queue_prefix": self.prefix})

    @activity.defn(name="start_attempt")
    async def start_attempt(self, inp: StartAttempt) -> AttemptGrant:
        launch, resume = await self.store.start_attempt(inp.job_id, inp.allocation_id)
        if not launch:
            return AttemptGrant(launch=False)
        request = await self.store.request_of(inp.job_id)
        # Every job gets a place to checkpoint: one without an interval may still save on SIGTERM
        # (the policy just cannot count on it).
        return AttemptGrant(
            launch=True,
            checkpoint_uri=checkpoint_uri(self.bucket, inp.job_id),
            resume_from=object_uri(self.bucket, resume["key"]) if resume else None,
            resume_seq=resume["seq"] if resume else None,
            resume_sha256=resume["sha256"] if resume else None,
            checkpoint_interval=request.checkpoint_interval,
            checkpoint_phase=await self.store.checkpoint_phase(inp.allocation_id),
        )

    @activity.defn(name="end_attempt")
    async def end_attempt(self, inp: EndAttempt) -> None:
        await self.store.end_attempt(inp.job_id, inp.allocation_id, inp.end_reason, inp.exit_code,
                                     inp.next_state, inp.reason, inp.machine_id, inp.unusable_checkpoint,
                                     inp.failures_in_a_row)
        if inp.next_state.terminal:
            self._sweep_later(inp.job_id)

    def _sweep_later(self, job_id: str) -> None:
        """Sweep an ended job's leftovers from the checkpoint store, after the answer, not before:
        the job's end must not wait for a slow store."""
        if self.s3 is not None:
            task = asyncio.create_task(self._sweep(job_id))
            self._sweeps.add(task)
            task.add_done_callback(self._sweeps.discard)

    async def _sweep(self, job_id: str) -> None:
        try:
            complete = await self.store.complete_checkpoints(job_id)
        except Exception as e:  # the job has ended all the same; its leftovers stay
            activity.logger.warning("cannot sweep the checkpoints of %s: %s", job_id, e)
            return
        await sweep_ended_job(self.s3, self.bucket, job_id, complete)

    async def settled(self) -> None:
        """Wait for the sweeps that ended jobs started (for tests, and before closing)."""
        while self._sweeps:
            await asyncio.gather(*self._sweeps, return_exceptions=True)

    @activity.defn(name="doubt_unusable_checkpoint")
    async def doubt_unusable_checkpoint(self, report: UnusableReport) -> str | None:
        """Why the machine's word that its resume checkpoint is unusable is doubted (the store
        holds it as committed, and nobody said so of it before), or None: believed."""
        if self.s3 is None:
            return None
        # A retry after the doubt was recorded answers as the first call did, whatever S3 says
        # now; a word after another's doubt is believed without asking S3.
        doubted, this_one = await self.store.earlier_doubt(report.job_id, report.allocation_id, report.seq)
        if doubted:
            return this_one
        committed = await self.store.resumed_checkpoint(report.job_id, report.allocation_id, report.seq)
        if committed is None:
            return None  # not the checkpoint it resumed from, or no longer complete
        try:
            differs = await asyncio.wait_for(verify_object(self.s3, self.bucket, report.job_id, committed),
                                             STORE_LOOK_S)
        except (CheckpointStoreUnavailable, TimeoutError) as e:
            # Unable to look, the job's word is all there is: as before the control plane looked.
            activity.logger.warning("cannot check checkpoint %d of %s in the store (%s): taking the job's word",
                                    report.seq, report.job_id, str(e) or "no answer in time")
            return None
        if differs is not None:
            return None  # the store agrees that it is not what was committed
        return await self.store.doubt_unusable(report.job_id, report.allocation_id, report.seq,
                                               report.machine_id, report.said)

    @activity.defn(name="machines_silent_for")
    async def machines_silent_for(self, machine_ids: list[str]) -> list[float | None]:
        """Seconds since each machine was last heard (None: never): a job's watch that timed out
        on a machine heard all along was lost with the server's heartbeats, not with the agent."""
        return await self.store.silent_for(machine_ids)

    @activity.defn(name="machines_heard")
    async def machines_heard(self, ask: HearingAsk) -> list[str]:
        """Per machine, HEARD, SILENT or UNSURE (``Store.hearing``): a job's watch that timed out on
        machines heard all along was lost with the server's heartbeats, not with the agents."""
        return await self.store.hearing(ask.machine_ids, ask.within)

    @activity.defn(name="set_job_state")
    async def set_job_state(self, inp: JobStateChange) -> None:
        if inp.state is not JobState.checkpointing:
            raise ApplicationError(f"set_job_state sets only {JobState.checkpointing.value}, not {inp.state.value}",
                                   non_retryable=True)
        await self.store.mark_checkpointing(inp.job_id)

    @activity.defn(name="mark_attempt_stopping")
    async def mark_attempt_stopping(self, inp: AttemptStopping) -> None:
        await self.store.mark_stopping(inp.allocation_id, inp.grace_period, inp.reason)

    @activity.defn(name="set_priority")
    async def set_priority(self, inp: PriorityChange) -> bool:
        return await self.store.set_priority(inp.job_id, inp.priority.value)

    @activity.defn(name="abandon_allocations")
    async def abandon_allocations(self, abandoned: list[Abandoned]) -> None:
        # A signal can fail for a workflow that still runs (its signal limit, say): only the
        # server's word that the workflow has ended lets its allocation go.
        verdicts = await self._workflows_ended([(a.workflow_id_prefix, a.job_id) for a in abandoned])
        for a, ended in zip(abandoned, verdicts):
            if ended:
                await self._abandon(a)
            else:
                activity.logger.warning("job %s's workflow still runs: allocation %d is kept", a.job_id,
                                        a.allocation_id)

    @activity.defn(name="reconcile_allocations")
    async def reconcile_allocations(self, inp: Reconcile) -> int:
        """Abandon the cluster's live allocations whose job workflow no longer runs (terminated,
        timed out, or never there); returns how many. A workflow that cannot be asked now counts
        as running: only the server's word that it is closed or unknown condemns an allocation."""
        live = await self.store.live_allocations(inp.cluster)
        verdicts = await self._workflows_ended([(inp.workflow_id_prefix, a["job_id"]) for a in live])
        for a, ended in zip(live, verdicts):
            if ended:
                await self._abandon(Abandoned(job_id=a["job_id"], allocation_id=a["id"],
                                              started=a["state"] != "placed"))
        return sum(verdicts) + await self._end_orphaned_queue(inp)

    async def _end_orphaned_queue(self, inp: Reconcile) -> int:
        """Fail the cluster's queued jobs whose workflow has ended (terminated while the job
        waited); returns how many. Left queued, such a job would be placed (perhaps preempting
        work for it) only to have its placement refused. Temporal's visibility names the
        candidates in one question (closed job workflows whose last published state is not an
        end), instead of one question per queued job; the server's word on each, as for the
        allocations, condemns it."""
        queued = await self.store.queued_jobs(inp.cluster)
        if not queued:
            return 0
        closed = await self._closed_unfinished_job_workflows(inp.cluster)
        orphans = [j for j in queued if inp.workflow_id_prefix + job_workflow_id(j) in closed]
        verdicts = await self._workflows_ended([(inp.workflow_id_prefix, j) for j in orphans])
        for job_id, ended in zip(orphans, verdicts):
            if ended:
                activity.logger.warning("job %s's workflow is gone: it leaves the queue", job_id)
                # No allocation to give back, unless a cycle placed it since the queue was read:
                # then that placement, which no workflow will take up, is given back with it.
                await self.store.end_attempt(job_id, None, EndReason.not_started, None, JobState.failed,
                                             "its workflow ended while the job was queued")
                self._sweep_later(job_id)
        return sum(verdicts)

    async def _closed_unfinished_job_workflows(self, cluster: str) -> set[str]:
        """Ids of closed job workflows (of this cluster, where its name can be quoted) whose
        last published state is not an end: terminated or timed out while the job lived. Empty
        when visibility cannot be asked now: the next reconcile asks again."""
        # Both spellings: a workflow from before the attribute was capitalised wrote the value.
        # None at all: one terminated while its admission ran, before it published anything,
        # whose admission still queued the job.
        unfinished = ", ".join(f"'{v}'" for s in JobState if not s.terminal for v in (s.attribute, s.value))
        # A run that continued as new is closed too, queued, and its job lives on in the next.
        query = (f"WorkflowType = 'JobWorkflow' AND ExecutionStatus != 'Running' "
                 f"AND ExecutionStatus != 'ContinuedAsNew' AND (JobState IN ({unfinished}) OR JobState IS NULL)")
        if _QUOTABLE.fullmatch(cluster):
            query += f" AND (Cluster = '{cluster}' OR Cluster IS NULL)"
        try:
            return {w.id async for w in self.client.list_workflows(query)}
        except RPCError as e:
            activity.logger.warning("cannot list the closed job workflows of %s: %s", cluster, e)
            return set()

    async def _abandon(self, a: Abandoned) -> None:
        activity.logger.warning("job %s's workflow is gone: releasing allocation %d", a.job_id, a.allocation_id)
        if a.started:
            await self.store.end_attempt(a.job_id, a.allocation_id, EndReason.cancelled, None, JobState.failed,
                                         "its workflow ended while the job ran; its GPUs were taken back")
        else:
            await self.store.end_attempt(a.job_id, a.allocation_id, EndReason.not_started, None,
                                         JobState.failed, "its workflow ended without taking up its placement")
        self._sweep_later(a.job_id)

    async def _workflows_ended(self, jobs: list[tuple[str, str]]) -> list[bool]:
        """For each (workflow id prefix, job id): whether the server says its workflow is closed
        or unknown. One that cannot be asked now counts as running."""
        asking = asyncio.Semaphore(32)  # thousands of allocations: a few dozen questions at a time

        async def ended(prefix: str, job_id: str) -> bool:
            asked = DescribeWorkflowExecutionRequest(
                namespace=self.client.namespace,
                execution=WorkflowExecution(workflow_id=prefix + job_workflow_id(job_id)))
            async with asking:
                try:
                    answer = await self.client.workflow_service.describe_workflow_execution(asked)
                except RPCError as e:
                    if e.status == RPCStatusCode.NOT_FOUND:
                        return True
                    activity.logger.warning("cannot ask about %s's workflow: %s", job_id, e)
                    return False
                return answer.workflow_execution_info.status in ENDED

        return list(await asyncio.gather(*(ended(prefix, job_id) for prefix, job_id in jobs)))

    @activity.defn(name="wake_scheduler")
    async def wake_scheduler(self, inp: Wake) -> None:
        began = time.monotonic()
        await wake_scheduler(self.client, inp.cluster, self.prefix, inp.reason, self.loop)
        if time.monotonic() - began > 1.0:
            activity.logger.warning("waking the scheduler of %s took %.1f s", inp.cluster, time.monotonic() - began)


async def wake_scheduler(client: Client, cluster: str, prefix: str = "", reason: str = "",
                         loop: SchedulerInput | None = None) -> None:
    """Signal the cluster's scheduler, starting it if it is not running (signal-with-start);
    ``loop`` gives the tick and continue-as-new settings a newly started loop runs with."""
    await _signal_with_start(client, cluster, prefix, loop, "wake", reason)


async def configure_scheduler(client: Client, cluster: str, prefix: str, loop: SchedulerInput) -> None:
    """Give the cluster's scheduler a control worker's loop settings, also one that runs already
    (a control worker starting), starting it if it is not running."""
    settings = LoopSettings(tick_seconds=loop.tick_seconds, cycles_per_run=loop.cycles_per_run,
                            reconcile_seconds=loop.reconcile_seconds)
    await _signal_with_start(client, cluster, prefix, loop, "configure", settings)


async def _signal_with_start(client: Client, cluster: str, prefix: str, loop: SchedulerInput | None,
                             signal: str, arg) -> None:
    settings = loop or SchedulerInput(cluster=cluster)
    await client.start_workflow(
        SCHEDULER_WORKFLOW,
        settings.model_copy(update={"cluster": cluster, "workflow_id_prefix": prefix}),
        id=prefix + scheduler_workflow_id(cluster),
        task_queue=prefix + CONTROL_TASK_QUEUE,
        start_signal=signal,
        start_signal_args=[arg],
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
