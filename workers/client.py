"""The typed Python client for pipelines and the CLI: submit, status, list, cancel, bump, wait.

    async with await GpuschedClient.connect() as gs:       # the embedded stack, or GPUSCHED_* env
        sub = await gs.submit(JobRequest(job_id=..., team="vision", num_gpus=8, command=[...]))
        view = await gs.wait(sub.job_id, timeout=3600)

Submitting starts the job's ``JobWorkflow``; the workflow itself checks the spec, quota and queue
cap (a pipeline that starts ``JobWorkflow`` with the Temporal SDK gets the same checks). The
client checks first too, so that a refusal comes back at once as ``SubmitRefused``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from pydantic import BaseModel
from temporalio.client import (Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowQueryFailedError,
                              WorkflowUpdateFailedError)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.rows import admission_verdict, iso
from activities.store import Store
from scheduler.cycle import run_cycle
from scheduler.models import Priority, Quota
from scheduler.quotas import quota_of
from workers.settings import Settings, connect_temporal, load_settings
from workflows.types import (
    CONTROL_TASK_QUEUE,
    JOB_FAILED,
    JOB_WORKFLOW,
    JobOutcome,
    JobRequest,
    JobState,
    JobView,
    PriorityBump,
    job_workflow_id,
    team_problem,
)


class ClientError(Exception):
    """A request gpusched refuses; the message says why and what to do."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class SubmitRefused(ClientError):
    pass


class UnknownJob(ClientError):
    pass


class NotYetAdmitted(ClientError):
    """The job's workflow started, but nothing admitted it in time (the control worker is down
    or busy): it is not refused, and will be admitted once a control worker runs."""


class Submitted(BaseModel):
    job_id: str
    cluster: str | None
    position: int | None  # 1-based place in the queue; 0 when already placed
    estimated_start: str | None  # ISO 8601, or None when it cannot start as the cluster is
    # The job's state as the store had it when the submit answered (queued, placed, running, …);
    # a submit sent again under the id of a job that has ended (succeeded, failed, cancelled) is
    # that job, and says so, with no position or estimate.
    state: str = "queued"
    # The job's priority class as the store has it: another than the submit's when this submit was
    # sent again for a job whose priority a bump has changed (or that was asked with another).
    priority: str | None = None


ENDED = frozenset(state.value for state in JobState if state.terminal)  # a job in one of these stays in it
CONNECT_TIMEOUT = 10.0  # seconds for the database and Temporal to answer a new connection
# What a submit sent again may differ in from the job's stored request: the time it was sent,
# and the priority, which a bump rewrites there.
CHANGES_AFTER_SUBMIT = {"submit_time", "priority"}


def same_request(known: JobRequest, request: JobRequest) -> bool:
    """Whether ``request`` asks for the job ``known`` already is (a submit sent again)."""
    return known.model_dump(exclude=CHANGES_AFTER_SUBMIT) == request.model_dump(exclude=CHANGES_AFTER_SUBMIT)


def new_job_id() -> str:
    return "j-" + uuid.uuid4().hex[:12]


class GpuschedClient:
    def __init__(self, settings: Settings, temporal: Client, store: Store):
        self.settings = settings
        self.temporal = temporal
        self.store = store

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> "GpuschedClient":
        settings = settings or load_settings()
        # A server that takes the connection and never answers must not hang a command.
        store = await Store.connect(settings.pg_dsn, min_size=1, max_size=4, timeout=CONNECT_TIMEOUT)
        try:
            temporal = await asyncio.wait_for(connect_temporal(settings), CONNECT_TIMEOUT)
        except Exception:
            await store.close()
            raise
        return cls(settings, temporal, store)

    async def close(self) -> None:
        await self.store.close()

    async def __aenter__(self) -> "GpuschedClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def history_url(self, job_id: str) -> str | None:
        """The job's workflow in the Temporal UI, where its whole history is."""
        ui = self.settings.temporal_ui_url
        if not ui:
            return None
        workflow_id = self.settings.task_queue_prefix + job_workflow_id(job_id)
        return f"{ui.rstrip('/')}/namespaces/{self.settings.temporal_namespace}/workflows/{workflow_id}"

    def _handle(self, job_id: str):
        return self.temporal.get_workflow_handle(self.settings.task_queue_prefix + job_workflow_id(job_id),
                                                 result_type=JobOutcome)

    # --- submit -----------------------------------------------------------------------------

    async def submit(self, request: JobRequest) -> Submitted:
        # A submit tried again after its job was admitted (its first answer lost) is that job:
        # asked before the quota check, which its own first submit's place in the queue could fail.
        known = await self.store.request_of(request.job_id)
        if known is not None and not same_request(known, request):
            # Asked before Temporal: once an ended job's workflow is past the namespace's
            # retention, nothing there refuses its id any more, and a new workflow would only be
            # refused at admission after this submit had answered that it was accepted.
            raise SubmitRefused(await self._taken_because(request.job_id), "job_id")
        if known is None:
            verdict = await self._check(request)
            if not verdict.accepted:
                raise SubmitRefused(verdict.reason, verdict.field)
        try:
            # An id names one job for good: a second workflow under it, even once the first has
            # ended, would wait for a job the store already has (and has finished).
            await self.temporal.start_workflow(
                JOB_WORKFLOW, request,
                id=self.settings.task_queue_prefix + job_workflow_id(request.job_id),
                task_queue=self.settings.task_queue_prefix + CONTROL_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            )
        except (WorkflowAlreadyStartedError, RPCError) as e:
            if not (isinstance(e, WorkflowAlreadyStartedError) or e.status == RPCStatusCode.ALREADY_EXISTS):
                raise
            if not await self._same_submit(request):
                raise SubmitRefused(await self._taken_because(request.job_id), "job_id") from None
            # The same request under the same id: a submit tried again (its first answer was
            # lost, or it was not admitted in time), which is that job, not a second one.
        view = await self._admitted(request)
        position, eta, state = await self._estimate(view)
        if state in ENDED:  # ended already, or while the estimate looked
            position = eta = None
        return Submitted(job_id=request.job_id, cluster=view.cluster, position=position, estimated_start=eta,
                         state=state, priority=view.priority)

    async def _taken_because(self, job_id: str) -> str:
        """Why an id cannot be used again, in words: an id names one job for good, even one that
        was refused (its workflow ended without a job row)."""
        if await self.store.request_of(job_id) is None and (why := await self._refused_because(job_id)):
            return f"job id '{job_id}' was used by a submit that was refused ({why}); choose another id"
        return f"a job with id '{job_id}' already exists; choose another id"

    async def _refused_because(self, job_id: str) -> str | None:
        """For an id without a job row: why its job workflow ended without one (refused at
        admission, say), or None when there is no such workflow, or it still runs."""
        try:
            desc = await self._handle(job_id).describe()
        except RPCError:
            return None
        if desc.status == WorkflowExecutionStatus.RUNNING:
            return None
        return await _why_it_ended(self._handle(job_id), desc.status)

    async def _same_submit(self, request: JobRequest) -> bool:
        """Whether the job already under this id was asked for with this very request: the one
        admitted, or else (a question to Temporal, asked only once the id is known to be taken)
        the one its workflow, still waiting for its admission, started with."""
        known = await self.store.request_of(request.job_id)
        if known is None:
            known = await self._waiting_with(request.job_id)
        return known is not None and same_request(known, request)

    async def _waiting_with(self, job_id: str) -> JobRequest | None:
        """The request a job workflow that still runs was started with (from its first event)."""
        handle = self._handle(job_id)
        try:
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                return None
            async for event in handle.fetch_history_events():
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                [started] = await self.temporal.data_converter.decode(payloads, [JobRequest])
                return started
        except (RPCError, ValueError, TypeError):
            return None
        return None

    async def _check(self, request: JobRequest):
        quotas = await self.store.list_quotas()
        quota = quota_of(quotas, request.team)
        quota_row = None if quota is None else {
            "guaranteed": quota.guaranteed, "max_gpus": quota.max, "queue_cap": quota.queue_cap}
        waiting = await self.store.team_waiting(request.team)
        capacity = await self.store.capacity()
        return admission_verdict(request, quota_row, capacity, waiting)

    # Seconds `cancel` waits for a job workflow to say whether it may be asked to cancel by Temporal
    # too (a query needs a worker): without an answer, the signal alone cancels the job.
    MARK_WAIT = 5.0
    ADMIT_WAIT = 30.0  # seconds a submit waits for its admission before saying it is not yet

    async def _admitted(self, request: JobRequest, timeout: float | None = None) -> JobView:
        """Wait for the workflow's admission step: the job row appears, or the workflow ends
        refused (a race with another submit for the team's last queue slot, say). A row of
        another request under the id (a submit of it that raced this one) is not this one's
        admission: this one's workflow is refused, and that is the answer."""
        job_id = request.job_id
        handle = self._handle(job_id)
        timeout = self.ADMIT_WAIT if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            view = await self.store.job_view(job_id)
            if view is not None:
                known = await self.store.request_of(job_id)
                if known is not None and same_request(known, request):
                    return view
            desc = await handle.describe()
            if desc.status != WorkflowExecutionStatus.RUNNING:
                raise SubmitRefused(await _why_it_ended(handle, desc.status))
            if asyncio.get_running_loop().time() > deadline:
                raise NotYetAdmitted(f"job {job_id} was submitted but not admitted within {timeout:.0f} s; "
                                     "it will be once a control worker runs (is one running? `gpusched dev "
                                     f"status`); `gpusched status {job_id}` follows it")
            await asyncio.sleep(0.05)

    async def _estimate(self, view: JobView, wait_for_cycle: float = 1.0) -> tuple[int | None, str | None, str]:
        """(position, estimated start, the job's state as last read)."""
        # The scheduler's own answer: the job's admission woke its cycle, which writes every queued
        # job's position and estimated start (or places it).
        deadline = asyncio.get_running_loop().time() + wait_for_cycle
        while view.state == "queued" and view.position is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            view = await self.status(view.job_id)
        if view.state != "queued":  # placed already: it starts as its agent launches it
            started = view.attempts[-1].started_at if view.attempts else None
            return 0, started or iso(time.time()), view.state
        if view.position is not None or view.estimated_start is not None:
            # An estimate without a place: held back after infrastructure failures in a row (its
            # hold's end), out of the cycle's queue until then.
            return view.position, view.estimated_start, view.state
        # No cycle yet (the loop is busy or restarting): the same core on a read-only snapshot.
        snapshot = await self.store.snapshot(view.cluster)
        for p in run_cycle(snapshot).pending:
            if p.job_id == view.job_id:
                return p.position, iso(p.estimated_start), view.state
        return 0, iso(snapshot.now), view.state  # the core would place it this cycle

    # --- reading ----------------------------------------------------------------------------

    async def status(self, job_id: str) -> JobView:
        view = await self.store.job_view(job_id)
        if view is None:
            if await self._waiting_with(job_id) is not None:
                # Its workflow runs but nothing has admitted it (the store has no row until then).
                raise NotYetAdmitted(f"job {job_id} is submitted but not admitted yet: no control worker has "
                                     "taken it up (is one running? `gpusched dev status` shows it); it is admitted "
                                     "and queued once one runs")
            if why := await self._refused_because(job_id):
                # Its submit answered before the admission (not admitted in time), which then refused it.
                raise UnknownJob(f"job {job_id} was refused at its admission: {why}; nothing of it ran")
            raise UnknownJob(f"no job '{job_id}'; `gpusched list` shows the jobs")
        return view

    async def list(self, team: str | None = None, state: str | None = None, limit: int = 1000) -> list[JobView]:
        """The newest ``limit`` jobs that match, oldest first."""
        return await self.store.list_jobs(team=team, state=state, limit=limit)

    # --- changing ---------------------------------------------------------------------------

    async def cancel(self, job_id: str, reason: str = "cancelled by request") -> JobView | None:
        """The job as it was when the cancel was sent; None for a job not admitted yet, whose
        workflow takes the cancel and ends it, cancelled, as soon as it is admitted."""
        try:
            view = await self.status(job_id)
        except NotYetAdmitted:
            view = None
        if view is not None and view.state in ENDED:
            raise ClientError(f"job {job_id} has already ended ({view.state})")
        try:
            await self._handle(job_id).signal("cancel", reason)
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
            # It ended between the look and the signal (or Temporal no longer keeps it).
            raise ClientError(f"job {job_id} has already ended ({(await self.status(job_id)).state})") from None
        # After the signal, which names the reason: so the workflow ends Canceled, not Completed,
        # in the Temporal UI's list. The signal alone cancels the job; a workflow that would be cut
        # short by a cancellation of Temporal's (one begun before those were the job's cancel, or a
        # worker of then, which does not know the question) is not asked one.
        handle = self._handle(job_id)
        try:
            if await asyncio.wait_for(handle.query("cancels_gracefully", result_type=bool), self.MARK_WAIT):
                await handle.cancel()
        except (WorkflowQueryFailedError, RPCError, asyncio.TimeoutError):
            pass  # ended meanwhile, or no worker answers now: the signal is the cancel all the same
        return view

    async def bump(self, job_id: str, priority: Priority) -> JobOutcome:
        await self.status(job_id)
        try:
            return await self._handle(job_id).execute_update(
                "bump_priority", PriorityBump(priority=priority), result_type=JobOutcome)
        except WorkflowUpdateFailedError as e:  # refused by its validator, or the job ended before it was made
            if (state := await self.ended_state(job_id)) is not None:
                raise ClientError(f"cannot change the priority of {job_id}: it ended ({state}) before the change "
                                  "was made") from None
            cause = getattr(e, "cause", None) or e
            raise ClientError(f"cannot change the priority of {job_id}: {getattr(cause, 'message', cause)}") from None
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise  # Temporal could not answer: the caller's "unreachable"
            raise ClientError(f"cannot change the priority of {job_id}: it has ended") from None

    async def ended_state(self, job_id: str) -> str | None:
        """The state a job ended in; None while it has not ended, or when that cannot be told."""
        try:
            view = await self.status(job_id)
        except Exception:  # the store cannot be asked now: the refusal says what Temporal said
            return None
        return view.state if view.state in ENDED else None

    async def wait(self, job_id: str, timeout: float | None = None) -> JobView:
        try:
            view = await self.status(job_id)
        except NotYetAdmitted:
            view = None  # its workflow runs: waited for like any other
        if view is not None and view.state in ENDED:
            return view  # ended: the store says how, even once Temporal no longer keeps the workflow
        try:
            await asyncio.wait_for(self._handle(job_id).result(), timeout)
        except WorkflowFailureError:
            pass  # terminated from outside gpusched: the job did not succeed, and the view says where it is
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
        return await self.status(job_id)

    # --- quotas -----------------------------------------------------------------------------

    async def set_quota(self, team: str, quota: Quota) -> None:
        if (problem := team_problem(team)) is not None:
            raise ClientError(problem, field="team")
        await self.store.set_quota(team, quota)

    async def quotas(self) -> dict[str, Quota]:
        return await self.store.list_quotas()


async def _why_it_ended(handle, status: WorkflowExecutionStatus) -> str:
    """Why a job workflow that has ended before its job was stored ended: the reason it was
    refused, or how it was cut short (terminated, timed out) before its admission."""
    try:
        outcome = await handle.result()
    except WorkflowFailureError as e:
        if isinstance(e.cause, ApplicationError) and e.cause.type == JOB_FAILED:
            return e.cause.message  # refused: the job's reason
        return f"its workflow ended {status.name.lower()}: {e.cause}"
    return outcome.reason or "refused"  # a workflow from before the job's end was its status
