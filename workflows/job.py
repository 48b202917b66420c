"""JobWorkflow: the durable life of one job, from admission to a terminal state.

    queued → placed → running → checkpointing (told to stop, in its grace) → preempted → queued (resuming) → …
           → succeeded | failed | cancelled

Algorithm overview
  1. Admission: validate the request and check the team's quota and queue cap in the store.
     A refused job ends at once, failed, with the reason (never a stuck workflow).
  2. Wait for a placement from the cluster's scheduler (or a cancel).
  3. Acknowledge it in the store (a duplicate or stale placement is dropped there).
  4. Run the attempt: one ``run_job`` activity per machine of the gang, on that machine's agent
     task queue, heartbeating. Until they end, a preemption or cancel stops them with the grace
     period. A watch whose heartbeats the server lost while the control plane heard its machine
     (Temporal was down) is watched again (``attach_job``) instead of the job requeued.
  5. Give the GPUs back and move on: succeeded, failed (exit code and last log lines), cancelled,
     or queued again (preempted, or the machine stopped heartbeating) → 2; once its history is
     long, as a new run of the workflow (continue-as-new), carrying the job's counts and signals.

The job's state, team, class, cluster and GPU count are search attributes, kept current.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from scheduler.models import Priority
    from workflows.types import (
        AGENT_SHUTDOWN,
        ATTEMPT_ABANDONED,
        ATTEMPT_NOT_HERE,
        ATTEMPT_ORDERS_MAX,
        EXIT_RETRY_LATER,
        JOB_FAILED,
        Admission,
        AttachOrder,
        AttemptGrant,
        AttemptStopping,
        CarriedOver,
        EndAttempt,
        EndReason,
        HEARD,
        SILENT,
        UNSURE,
        HearingAsk,
        JobOutcome,
        JobRequest,
        JobState,
        JobStateChange,
        PlacementSignal,
        PreemptSignal,
        PriorityBump,
        PriorityChange,
        RunJobInput,
        RunJobResult,
        StartAttempt,
        StopOrder,
        UnusableReport,
        Wake,
        agent_task_queue,
        first_error,
    )

JOB_STATE = SearchAttributeKey.for_keyword("JobState")
TEAM = SearchAttributeKey.for_keyword("Team")
PRIORITY_CLASS = SearchAttributeKey.for_keyword("PriorityClass")
CLUSTER = SearchAttributeKey.for_keyword("Cluster")
GPU_COUNT = SearchAttributeKey.for_int("GpuCount")

# One store call each (milliseconds): a control worker that dies during one is noticed at this timeout.
STORE_CALL = dict(start_to_close_timeout=timedelta(seconds=15),
                  retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200),
                                           maximum_interval=timedelta(seconds=5)))
# What a stop says of itself (a cancel's mark of its attempt): shown while it lasts, worth nothing
# after, so given up with the store down for a minute rather than holding up the attempt's end.
MARK_CALL = dict(STORE_CALL, schedule_to_close_timeout=timedelta(seconds=60))
# A look at the checkpoint store from the control plane: a HEAD, with the S3 client's retries.
STORE_LOOK = dict(start_to_close_timeout=timedelta(seconds=60), retry_policy=STORE_CALL["retry_policy"])
# How long a placed attempt may wait for its agent to pick it up, and how long an agent may be
# silent while running it, before the job gives the GPUs back and queues again.
AGENT_PICKUP = timedelta(seconds=30)
AGENT_HEARTBEAT = timedelta(seconds=10)
# A watch that timed out on a machine the control plane heard this recently (its agent heartbeats
# every 2 s) is watched again instead of requeued: the heartbeats were lost on the way to Temporal.
# A dead agent has been silent about AGENT_HEARTBEAT by the time its watch times out.
HEARD_WITHIN_S = 4.0
# While the control plane cannot tell whether it heard them (the API or Postgres was down with
# Temporal), it is asked again this often, for at most this long: the agent keeps a process whose
# watch was lost running for 60 s, for a watch to come again.
HEARING_POLL = timedelta(seconds=2)
HEARING_WAIT = timedelta(seconds=30)
# How long a job its cancel signal ended waits for the cancellation `gpusched cancel` asks of
# Temporal next, so that its workflow ends Canceled (a look at the workflow and a call: well under
# a second, unless the client's machine is starved).
TEMPORAL_CANCEL_WAIT = timedelta(seconds=5)
STOP_ASKED = "stop asked"  # a stop came while the control plane could not tell
MAX_WATCHED_AGAIN = 20  # per attempt: past it, the job is requeued as before (a history stays bounded)
STOP_PICKUP = timedelta(seconds=10)  # a stop order not taken up by an agent by then is dropped
# Temporal wants a limit on an attempt's run: a year, past any training run (at 14 days, jobs of
# weeks were requeued as if their agent had died, and one without checkpoints never ended).
RUN_LIMIT = timedelta(days=365)
# A gang's run orders go out at most this many bytes to a workflow task (gRPC takes 4 MiB in one
# message); one attempt's may not pass ATTEMPT_ORDERS_MAX (workflows/types.py).
ORDERS_BYTES_PER_TASK = 2 * 1024 * 1024
NEXT_TASK = timedelta(milliseconds=1)
# Infrastructure failures (not the job's own exit code) in a row before the job fails: an
# attempt that ran INFRA_STREAK_RESET or longer before its failure starts the count again, as a
# long job meets a machine's death now and then without anything being wrong with it, and an
# attempt preempted, or failed by the job itself and retried, ends the row.
MAX_INFRA_FAILURES = 5
INFRA_STREAK_RESET = timedelta(minutes=30)


def infra_failures_with(before: int, ran_for: timedelta | None) -> int:
    """The job's infrastructure failures in a row once its attempt, which ran ``ran_for``
    (None: it never started), has failed for want of its machine or agent."""
    if ran_for is not None and ran_for >= INFRA_STREAK_RESET:
        return 1
    return before + 1
LOG_LINES_IN_REASON = 10
# A run's history past either goes on in a new run between attempts, whatever the server suggests.
CONTINUE_AFTER_EVENTS = 10_000
CONTINUE_AFTER_BYTES = 10 * 1024 * 1024
SEEN_KEPT = 100  # placements handled whose ids a run hands on to the next


@workflow.defn(name="JobWorkflow")
class JobWorkflow:
    @workflow.init
    def __init__(self, raw: dict[str, Any], carried: CarriedOver | None = None) -> None:
        self.request: JobRequest | None = None
        self.state = JobState.queued
        self.cluster: str | None = None
        self.prefix = ""
        self.reason: str | None = None
        self.exit_code: int | None = None
        self.attempts = 0
        self.allocation_id: int | None = None
        self.placements: list[PlacementSignal] = []
        self.seen_allocations: set[int] = set()
        self.preempts: dict[int, PreemptSignal] = {}
        self.cancel_reason: str | None = None
        self.cancel_asked_of_temporal = False  # a cancellation of the workflow itself was requested
        self.takes_temporal_cancel = False  # such a cancellation is the job's cancel (not a cut)
        self.infra_failures = 0
        self.failures = 0  # attempts the command itself failed (its own non-zero exit)
        self.attempt_began = None  # when this attempt's processes were asked to start
        self.failed_host: str | None = None  # the machine whose agent failed this attempt
        self.resume_seq: int | None = None  # the checkpoint this attempt resumed from
        self.unusable_checkpoint: int | None = None  # that checkpoint, when the job found it unusable
        self.held_for: int = 0  # infrastructure failures in a row this requeue is for (held back)
        self.counted_infra = False  # whether the attempt under way ended as an infrastructure failure
        self.asked_id: str | None = None  # the job id the input named, even when it did not parse
        self.bumping = asyncio.Lock()  # one change of class at a time, in the order they came
        self.long_checks = 0  # the times this run found its history long between attempts
        if carried is not None:
            # Taken over before any handler runs: a change of class or a placement sent as the
            # run begins is handled in its first task, before `run`, and finds the job admitted.
            self.request = JobRequest.model_validate(raw)
            self._take_over(carried)

    # --- handlers ---------------------------------------------------------------------------

    @workflow.signal
    def placement(self, signal: PlacementSignal) -> None:
        # Re-sent until acknowledged: keep one copy, drop those already handled.
        if signal.allocation_id not in self.seen_allocations and all(
            p.allocation_id != signal.allocation_id for p in self.placements
        ):
            self.placements.append(signal)

    @workflow.signal
    def preempt(self, signal: PreemptSignal) -> None:
        self.preempts.setdefault(signal.allocation_id, signal)

    @workflow.signal
    def cancel(self, reason: str = "") -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason or "cancelled by request"

    # A change still being made when the job ends is dropped: an ended job has no class to change.
    # Its caller is refused ("the Workflow completed before the Update completed"), and the worker
    # does not warn that work was cut short.
    @workflow.update(unfinished_policy=workflow.HandlerUnfinishedPolicy.ABANDON)
    async def bump_priority(self, bump: PriorityBump) -> JobOutcome:
        if not workflow.patched("one-priority-bump-at-a-time"):
            return await self._bump(bump)
        # Two changes at once each wrote the store, then the workflow, in whichever order their
        # activities were reported done: a report held up (Temporal down, a worker killed after
        # its write) left the store with one class and the job's workflow with the other.
        # Taken in turn, the last change asked is the class in both.
        async with self.bumping:
            return await self._bump(bump)

    async def _bump(self, bump: PriorityBump) -> JobOutcome:
        await workflow.execute_activity("set_priority", PriorityChange(job_id=self.job_id, priority=bump.priority),
                                        **STORE_CALL)
        self.request = self.request.model_copy(update={"priority": bump.priority})
        self._publish()
        await self._wake("priority bump")
        return self.status()

    @bump_priority.validator
    def _validate_bump(self, bump: PriorityBump) -> None:
        if self.request is None or self.cluster is None:
            raise ValueError("the job has not been admitted yet")
        if self.state.terminal:
            raise ValueError(f"the job is already {self.state.value}")

    @workflow.query
    def cancels_gracefully(self) -> bool:
        """Whether a cancellation asked of Temporal is the job's cancel here, as the cancel
        signal is (a workflow begun before that would be cut short by one): `gpusched cancel`
        asks it after its signal only then."""
        return self.takes_temporal_cancel

    @workflow.query
    def status(self) -> JobOutcome:
        return JobOutcome(
            job_id=self.request.job_id if self.request else self.asked_id or workflow.info().workflow_id,
            state=self.state,
            priority=self.request.priority if self.request else None,
            cluster=self.cluster,
            exit_code=self.exit_code,
            reason=self.reason,
            attempts=self.attempts,
            allocation_id=self.allocation_id,
        )

    # --- the job's life ---------------------------------------------------------------------

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @workflow.run
    async def run(self, raw: dict[str, Any], carried: CarriedOver | None = None) -> JobOutcome:
        """``carried``: what the run before handed on, when it continued as new between attempts."""
        self.takes_temporal_cancel = workflow.patched("temporal-cancel-cancels-the-job")
        if not self.takes_temporal_cancel:
            return await self._life(raw)
        # A cancellation asked of Temporal itself (the UI's "Request Cancellation", `temporal
        # workflow cancel`) is the job's cancel, as `gpusched cancel` sends it: the job's life goes
        # on, shielded, to stop a running attempt with its grace and give its GPUs back through the
        # store, where the workflow cut short left the job "running" for good in its search
        # attributes and its allocation to the reconcile (ended as failed).
        life = asyncio.create_task(self._life(raw, carried))
        while True:
            try:
                outcome = await asyncio.shield(life)
                break
            except asyncio.CancelledError:
                if life.done():
                    raise
                current = asyncio.current_task()
                if current is not None and hasattr(current, "uncancel"):
                    current.uncancel()  # handled: later waits of this task are not cancelled again
                self.cancel_asked_of_temporal = True
                self.cancel("cancelled from Temporal (a cancellation of its workflow)")
        if not workflow.patched("job-end-is-the-workflow-status"):
            return outcome
        # The job's end is its workflow's, so the Temporal UI's list says how each job ended: a
        # failed job (refused included) fails its workflow, with the outcome as the failure's
        # details; a cancelled one is Canceled (`gpusched cancel` asks Temporal to cancel too,
        # after its signal names the reason).
        if outcome.state is JobState.failed:
            raise ApplicationError(outcome.reason or "failed", outcome.model_dump(mode="json"),
                                   type=JOB_FAILED, non_retryable=True)
        # Not while a change of class is still being made: it is dropped with the job's end, as
        # before (its caller told the job ended first), not made to an ended job during the wait.
        if (outcome.state is JobState.cancelled and not self.cancel_asked_of_temporal
                and workflow.all_handlers_finished()
                and workflow.patched("a-cancel-waits-for-its-temporal-cancellation")):
            # `gpusched cancel` asks Temporal to cancel after its signal: a job its signal ended at
            # once (queued, placed) finished first, and the UI listed it Completed, now and then.
            try:
                await workflow.wait_condition(lambda: self.cancel_asked_of_temporal, timeout=TEMPORAL_CANCEL_WAIT)
            except asyncio.TimeoutError:
                pass  # a cancel sent by the signal alone: it ends as the job did
            except asyncio.CancelledError:
                self.cancel_asked_of_temporal = True
        if outcome.state is JobState.cancelled and self.cancel_asked_of_temporal:
            raise asyncio.CancelledError(outcome.reason)
        return outcome

    async def _life(self, raw: dict[str, Any], carried: CarriedOver | None = None) -> JobOutcome:
        if carried is not None:  # taken over as the run began (__init__)
            self._publish()
            return await self._attempts()
        # The input is validated here, not by the data converter: a request that does not parse
        # must end the job with the reason, not fail every workflow task forever.
        asked = raw.get("job_id") if isinstance(raw, dict) else None
        self.asked_id = asked if isinstance(asked, str) else None
        try:
            request = JobRequest.model_validate(raw)
        except ValidationError as e:
            field, message = first_error(e)
            self.state, self.reason = JobState.failed, f"refused: {field}: {message}"
            if workflow.patched("refused-request-published"):
                # Found by `JobState='Failed'` like any other refused job.
                workflow.upsert_search_attributes([SearchAttributePair(JOB_STATE, self._state_attribute())])
            return self.status()
        self.request = request
        # 1. Admission.
        admission: Admission = await workflow.execute_activity(
            "admit_job", request, result_type=Admission, **STORE_CALL)
        if not admission.accepted:
            self.state, self.reason = JobState.failed, f"refused: {admission.reason}"
            self._publish()
            return self.status()
        self.cluster, self.prefix = admission.cluster, admission.task_queue_prefix
        self._publish()
        await self._wake("submitted")
        return await self._attempts()

    async def _attempts(self) -> JobOutcome:
        while True:
            if self._history_long():
                self.long_checks += 1
                # Temporal ends a workflow whose history passes 51,200 events or 50 MB, and a job
                # that lives long gets there (hundreds of attempts; a gang's large command and
                # env, carried once per machine, in dozens). Queued and holding no GPU, it goes on
                # as a new run of the same workflow, once no change of class is half made: a
                # placement that waits meanwhile goes with it (taking it up instead, while changes
                # kept coming, let their events run the history to its end).
                # A patch of its own each time: a run from before this code replays its long
                # history asking at loop tops where that code did not, is answered no, and an
                # answer holds for the rest of the run.
                if workflow.patched(f"continue-as-new-between-attempts-{self.long_checks}"):
                    await workflow.wait_condition(
                        lambda: workflow.all_handlers_finished() or self.cancel_reason is not None)
                    if self.cancel_reason is None:
                        workflow.continue_as_new(args=[self.request.model_dump(mode="json"), self._carried()])
            # 2. Wait for a placement, or a cancel.
            await workflow.wait_condition(lambda: bool(self.placements) or self.cancel_reason is not None)
            if self.cancel_reason is not None:
                await self._end(None, EndReason.cancelled, None, JobState.cancelled, self.cancel_reason)
                return self.status()
            placement = self.placements.pop(0)
            self.seen_allocations.add(placement.allocation_id)
            self.state = JobState.placed
            self._publish()
            # 3. Acknowledge it, and learn the newest complete checkpoint to resume from.
            grant: AttemptGrant = await workflow.execute_activity(
                "start_attempt", StartAttempt(job_id=self.job_id, allocation_id=placement.allocation_id),
                result_type=AttemptGrant, **STORE_CALL,
            )
            if not grant.launch:
                # A stale signal, or a placement taken back before it started: the job waits in
                # the queue again for its next one.
                if workflow.patched("unlaunched-placement-shows-queued"):
                    self.state = JobState.queued
                    self._publish()
                continue
            self.attempts = placement.attempt
            self.allocation_id = placement.allocation_id
            self.state = JobState.running
            self._publish()
            # 4. Run it.
            self.counted_infra = False
            end, exit_code, next_state, reason = await self._run_attempt(placement, grant)
            if not self.counted_infra and workflow.patched("infra-failures-row-broken-by-other-ends"):
                # Preempted, or its own failure retried: it ran, and ended for a reason of its
                # own, so the row of infrastructure failures ends here (before, failures days
                # apart added up to the five that fail a job). Requeued by the cycle off a dead
                # machine or sick GPU, or its agent shut down, it leaves the row as it was: a job
                # that kills its machine each time must still fail after five. (The first patch
                # ended the row on any such end; its histories replay as they ran.)
                if end in (EndReason.preempted, EndReason.failed) or not workflow.patched(
                        "infra-failures-row-kept-by-requeues"):
                    self.infra_failures = 0
                elif (self.infra_failures and self.attempt_began is not None
                      and workflow.now() - self.attempt_began >= INFRA_STREAK_RESET
                      and workflow.patched("infra-failures-row-ended-by-a-long-move")):
                    # Moved off after a long run (its machine drained, a GPU gone sick, its
                    # agent restarted): as a failure after such a run starts the count again,
                    # so does this, or a drain after a healthy day left one failure to the five.
                    self.infra_failures = 0
            # 5. Give the GPUs back and move on.
            await self._end(placement.allocation_id, end, exit_code, next_state, reason)
            self.allocation_id = None
            await self._wake(end.value)  # its GPUs are free for the next job
            if next_state.terminal:
                return self.status()

    def _history_long(self) -> bool:
        """Whether the run's history is long enough to go on in a new run: Temporal says so (its
        `limit.history*.suggestContinueAsNew`), or, for a server set not to, it is past our marks."""
        info = workflow.info()
        return (info.is_continue_as_new_suggested() or info.get_current_history_length() >= CONTINUE_AFTER_EVENTS
                or info.get_current_history_size() >= CONTINUE_AFTER_BYTES)

    def _carried(self) -> CarriedOver:
        waiting = {p.allocation_id for p in self.placements}
        return CarriedOver(
            cluster=self.cluster, task_queue_prefix=self.prefix, state=self.state, reason=self.reason,
            attempts=self.attempts, infra_failures=self.infra_failures, failures=self.failures,
            placements=self.placements, preempts=[p for a, p in self.preempts.items() if a in waiting],
            seen_allocations=sorted(self.seen_allocations)[-SEEN_KEPT:])

    def _take_over(self, carried: CarriedOver) -> None:
        self.cluster, self.prefix = carried.cluster, carried.task_queue_prefix
        self.state, self.reason, self.attempts = carried.state, carried.reason, carried.attempts
        self.infra_failures, self.failures = carried.infra_failures, carried.failures
        self.seen_allocations = set(carried.seen_allocations)
        self.placements = list(carried.placements)
        self.preempts = {signal.allocation_id: signal for signal in carried.preempts}

    async def _run_attempt(self, placement: PlacementSignal,
                           grant: AttemptGrant) -> tuple[EndReason, int | None, JobState, str]:
        alloc = placement.allocation_id
        hosts = placement.hosts
        self.attempt_began, self.failed_host = workflow.now(), None
        self.resume_seq, self.unusable_checkpoint = grant.resume_seq, None

        def run_order(rank: int, host) -> RunJobInput:
            """What the gang's rank is told to run on its host."""
            return RunJobInput(
                job_id=self.job_id,
                allocation_id=alloc,
                attempt=placement.attempt,
                command=self.request.command,
                gpus=host.gpus,
                env={**self.request.env,
                     "GPUSCHED_NODE_RANK": str(rank), "GPUSCHED_NUM_NODES": str(len(hosts)),
                     "GPUSCHED_NODES": " ".join(h.machine_id for h in hosts)},
                grace_period=placement.grace_period,
                working_dir=self.request.working_dir,
                checkpoint_uri=grant.checkpoint_uri,
                resume_from=grant.resume_from,
                resume_seq=grant.resume_seq,
                resume_sha256=grant.resume_sha256,
                checkpoint_interval=grant.checkpoint_interval,
                checkpoint_phase=grant.checkpoint_phase,
            )

        def watch(host, order: RunJobInput | None = None):
            """The activity that runs ``order`` on the host or, without one, watches the attempt's
            process there again."""
            if order is None:
                name, arg = "attach_job", AttachOrder(allocation_id=alloc)
            else:
                name, arg = "run_job", order
            return workflow.start_activity(
                name, arg,
                result_type=RunJobResult,
                task_queue=self.prefix + agent_task_queue(host.machine_id),
                schedule_to_start_timeout=AGENT_PICKUP,
                start_to_close_timeout=RUN_LIMIT,
                heartbeat_timeout=AGENT_HEARTBEAT,
                retry_policy=RetryPolicy(maximum_attempts=1),
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )

        def stop_order(host, grace: float, reason: str):
            """Stop the attempt's process on the host with this grace; dropped if not picked up soon."""
            return workflow.start_activity(
                "stop_job", StopOrder(allocation_id=alloc, grace_period=grace, reason=reason),
                task_queue=self.prefix + agent_task_queue(host.machine_id),
                schedule_to_start_timeout=STOP_PICKUP, start_to_close_timeout=STOP_PICKUP,
                retry_policy=RetryPolicy(maximum_attempts=1))

        orders = [run_order(rank, host) for rank, host in enumerate(hosts)]
        sizes = [len(order.model_dump_json().encode()) for order in orders]  # bytes: the payloads' UTF-8
        if sum(sizes) > ATTEMPT_ORDERS_MAX and workflow.patched("attempt-orders-bounded"):
            # Each rank's order carries the command, the env and the list of the gang's machines,
            # and all of them go into the job's history, which Temporal ends at 50 MB: a lost job.
            spec = len(json.dumps(self.request.command, ensure_ascii=False).encode()) + len(
                json.dumps(self.request.env, ensure_ascii=False).encode())
            return (EndReason.failed, None, JobState.failed,
                    f"its run orders come to {sum(sizes) / 2**20:.1f} MiB over {len(hosts)} machines (each carries "
                    f"the command and env, {spec / 1024:.0f} KiB, and the list of the gang's machines), more than "
                    f"the {ATTEMPT_ORDERS_MAX // 2**20} MiB a job's history can take for one attempt; make the "
                    "command and env smaller (put the arguments in a file the command reads), or ask for fewer GPUs")
        runs = []
        in_task = 0  # bytes of orders in the workflow task being made
        for host, order, size in zip(hosts, orders, sizes):
            if runs and in_task + size > ORDERS_BYTES_PER_TASK and workflow.patched("gang-orders-in-batches"):
                # A workflow task's commands travel in one gRPC message, which Temporal refuses
                # past 4 MiB: the task failed on every try and the workflow was ended. The rest
                # go in the next task (a timer of a millisecond makes one).
                await workflow.sleep(NEXT_TASK)
                in_task = 0
            in_task += size
            runs.append(watch(host, order))

        def stop_asked() -> bool:
            return alloc in self.preempts or self.cancel_reason is not None

        def failed_run() -> bool:
            return any(r.done() and (r.exception() is not None or r.result().exit_code != 0) for r in runs)

        watched_again = 0
        stopping = False  # asked to stop while its lost watches' machines were being listened for
        while True:
            await workflow.wait_condition(lambda: stop_asked() or failed_run() or all(r.done() for r in runs))
            lost = [i for i, r in enumerate(runs) if _heartbeats_lost(r)]
            failed = [i for i, r in enumerate(runs)
                      if r.done() and (r.exception() is not None or r.result().exit_code != 0)]
            if not lost or lost != failed or watched_again >= MAX_WATCHED_AGAIN:
                break
            if not workflow.patched("watch-again-after-lost-heartbeats"):
                break
            # The server heard no heartbeat of these watches for AGENT_HEARTBEAT. If the control
            # plane heard their machines meanwhile, the agents live and so, most likely, do the
            # processes: it was Temporal that could not hear (down, restarting, unreachable).
            # Requeueing would cost every running job of the fleet its work since its last
            # checkpoint and a restart; watch them again instead (an agent with no such process
            # says so, and the job is requeued then).
            if workflow.patched("wait-until-the-control-plane-can-tell"):
                heard = await self._machines_heard([hosts[i].machine_id for i in lost], stop_asked)
                if heard == STOP_ASKED and workflow.patched("stop-while-unsure-is-a-stop"):
                    # The processes most likely run on (their agents keep them a while for a new
                    # watch): stopped like any other, with the grace, where the lost watches
                    # taken for the attempt's failure requeued the job at once and left them to
                    # their agents, to be killed as orphans with a few seconds to checkpoint.
                    stopping = True
                if heard != HEARD:
                    break
            else:
                silent = await workflow.execute_activity(
                    "machines_silent_for", [hosts[i].machine_id for i in lost],
                    result_type=list[float | None], **STORE_CALL)
                if any(s is None or s > HEARD_WITHIN_S for s in silent):
                    break
            watched_again += 1
            workflow.logger.warning("job %s: attempt %d watched again on %s (its heartbeats were lost; "
                                    "the machines were heard)", self.job_id, placement.attempt,
                                    ", ".join(hosts[i].machine_id for i in lost))
            for i in lost:
                runs[i] = watch(hosts[i])
        if not stopping and (failed_run() or all(r.done() for r in runs)):
            return await self._ended(runs, [h.machine_id for h in hosts])
        # Asked to stop: each process gets SIGTERM, the grace period to checkpoint, then SIGKILL.
        preempt = self.preempts.get(alloc)
        if preempt is not None and self.cancel_reason is None and (
                preempt.end_reason is EndReason.preempted
                or (preempt.grace_period > 0 and workflow.patched("a-graceful-move-shows-checkpointing"))):
            # Told to stop with a grace: displaced, or moved off a drained machine or a sick GPU.
            # (A move showed `running` through its grace: an operator watching a drain by
            # `gpusched list --state checkpointing` saw nothing move.)
            self.state = JobState.checkpointing
            self._publish()
            await workflow.execute_activity(
                "set_job_state", JobStateChange(job_id=self.job_id, state=JobState.checkpointing), **STORE_CALL)
        marked = None
        if self.cancel_reason is not None and workflow.patched("a-cancel-marks-its-attempt-stopping"):
            # Said while the processes checkpoint (`gpusched status`: "stopping: …"), and the
            # cycle expects the GPUs back by the grace's end instead of displacing the job.
            marked = workflow.start_activity(
                "mark_attempt_stopping", AttemptStopping(allocation_id=alloc, grace_period=placement.grace_period,
                                                         reason=self.cancel_reason), **MARK_CALL)
        stops = []
        if preempt is not None and self.cancel_reason is None and workflow.patched("stop-with-ordered-grace"):
            # The agents stop with the preemption's grace, not the one the attempt was launched
            # with: the cluster's grace may have changed since, and a gang that lost a machine
            # is given none. Best effort: an agent that cannot be reached stops with its own.
            stops = [stop_order(host, preempt.grace_period, preempt.reason)
                     for host, run in zip(hosts, runs) if not run.done()]
        await self._stop(runs)
        for stop in stops:
            stop.cancel()  # one not picked up by now has nothing left to stop
        await asyncio.gather(*stops, return_exceptions=True)
        lost = [i for i, r in enumerate(runs) if _heartbeats_lost(r)]
        if lost and workflow.patched("stop-reaches-a-lost-watch"):
            # The stop and a watch's heartbeat timeout came in one workflow task: the stop is seen
            # first, so the watch was cancelled after it had gone, and its process runs on (its
            # agent keeps it a while for a new watch). Stop it there and watch it until it has
            # ended, before the GPUs are given back (they were freed with it still running).
            ordered = preempt is not None and self.cancel_reason is None
            grace = preempt.grace_period if ordered else placement.grace_period
            reason = preempt.reason if ordered else (self.cancel_reason or "stopped")
            for i in lost:
                try:
                    await stop_order(hosts[i], grace, reason)
                except ActivityError:
                    continue  # its agent cannot be reached: its machine is gone, or its next agent reaps it
                runs[i] = watch(hosts[i])
            await asyncio.gather(*runs, return_exceptions=True)
        if marked is not None:
            # Before the attempt is ended (the mark of an ended one is dropped), and after every
            # stop is sent: none waits for the store.
            await asyncio.gather(marked, return_exceptions=True)
        if workflow.patched("stopped-success-completes") and all(_ended_on_its_own(r) for r in runs):
            # Every process had already exited 0 when the stop reached it: the job is done,
            # and running it again would only repeat its work.
            return EndReason.completed, 0, JobState.succeeded, "completed"
        if self.cancel_reason is not None:
            return EndReason.cancelled, None, JobState.cancelled, self.cancel_reason
        if preempt.end_reason is not EndReason.preempted:
            return preempt.end_reason, None, JobState.queued, f"requeued: {preempt.reason}"
        self.state = JobState.preempted
        self._publish()
        return EndReason.preempted, None, JobState.queued, f"preempted: {preempt.reason}"

    async def _machines_heard(self, machine_ids: list[str], stop_asked) -> str:
        """HEARD if the control plane heard each machine within HEARD_WITHIN_S. While it cannot
        tell (the API or Postgres was down too: a whole control plane back from an outage has
        heard nobody yet), it is asked again every HEARING_POLL until it can, for at most
        HEARING_WAIT: SILENT for a machine heard silent while it listened, STOP_ASKED for a stop
        asked meanwhile, UNSURE for the wait run out."""
        deadline = workflow.now() + HEARING_WAIT
        while True:
            verdicts = await workflow.execute_activity(
                "machines_heard", HearingAsk(machine_ids=machine_ids, within=HEARD_WITHIN_S),
                result_type=list[str], **STORE_CALL)
            if all(v == HEARD for v in verdicts):
                return HEARD
            if SILENT in verdicts:
                return SILENT
            if workflow.now() >= deadline:
                return STOP_ASKED if stop_asked() else UNSURE
            try:
                await workflow.wait_condition(stop_asked, timeout=HEARING_POLL)
                return STOP_ASKED
            except asyncio.TimeoutError:
                pass

    async def _ended(self, runs, machines: list[str]) -> tuple[EndReason, int | None, JobState, str]:
        """How an attempt ended on its own: all processes done, or one failed (then the rest of
        the gang is stopped, as a gang runs whole or not at all)."""
        for r, machine in zip(runs, machines):
            if not r.done() or r.exception() is None:
                continue
            await self._stop(runs)
            self.failed_host = machine
            return self._infra_failure(r.exception())
        failed = [r.result() for r in runs if r.done() and r.result().exit_code != 0]
        if failed:
            await self._stop(runs)
            result = failed[0]
            how = f"exit code {result.exit_code}" if result.exit_code is not None else f"signal {result.signal}"
            # Any rank's word, those that ended as the rest of the gang was stopped included: the
            # first to fail may be one whose peer never came up from its restore.
            unusable = reporter = None
            looked_at = result
            for r, machine in zip(runs, machines):
                looked_at = _result_of(r)
                if looked_at is not None and looked_at.resume_unusable:
                    unusable, reporter = looked_at.resume_unusable, machine
                    break
            if not workflow.patched("gang-failure-is-the-failed-ranks"):
                # Builds before it took the last rank looked at for the failed one (a := in a
                # generator rebound `result`); their histories replay so. A stopped rank has no
                # result, and such a run failed on every replay: those resume on the fixed path.
                result = looked_at
            if unusable and self.resume_seq is not None and workflow.patched("unusable-checkpoint-falls-back"):
                if workflow.patched("unusable-checkpoint-doubted"):
                    doubt = await workflow.execute_activity(
                        "doubt_unusable_checkpoint",
                        UnusableReport(job_id=self.job_id, allocation_id=self.allocation_id, seq=self.resume_seq,
                                       machine_id=reporter, said=unusable),
                        **STORE_LOOK)
                    if doubt:
                        return self._count_infra_failure(EndReason.machine_failure, doubt)
                # Its checkpoint is gone or corrupted: no fault of the job's, and sent back to it
                # the job would fail the same way every time. The end takes it for incomplete.
                self.unusable_checkpoint = self.resume_seq
                return self._count_infra_failure(
                    EndReason.machine_failure,
                    f"it could not resume from checkpoint {self.resume_seq} ({how}): {unusable}; the next "
                    "attempt resumes from the newest complete checkpoint before it, or from the start")
            sick = [fault for r in failed for fault in r.gpu_faults]
            if sick and workflow.patched("gpu-fault-requeues"):
                # A process that dies as its GPU fails died of the GPU: the job is not at fault.
                return self._count_infra_failure(
                    EndReason.machine_failure, f"it died ({how}) on a failing GPU ({', '.join(sick)})")
            lines = "\n".join(result.last_log_lines[-LOG_LINES_IN_REASON:])
            if result.exit_code == EXIT_RETRY_LATER and workflow.patched("exit-75-requeues"):
                # The job's way of saying that what it needs is not there now (its checkpoint
                # store unreachable): queued again, not the job's own failure.
                return self._count_infra_failure(
                    EndReason.machine_failure, "the command could not run for now (exit code 75)",
                    exit_code=result.exit_code, lines=lines)
            self.failures += 1
            tail = f":\n{lines}" if lines else ""  # no empty line for a command that wrote no log
            if self.failures <= self.request.max_retries:
                # The user asked for retries (a crash in the job's own code or libraries, NCCL
                # timing out): the next attempt resumes from the newest complete checkpoint.
                return (EndReason.failed, result.exit_code, JobState.queued,
                        f"requeued: the command failed with {how} (retry {self.failures} of "
                        f"{self.request.max_retries}){tail}")
            spent = f" (its {_retries(self.request.max_retries)} spent)" if self.request.max_retries else ""
            return EndReason.failed, result.exit_code, JobState.failed, f"the command failed with {how}{spent}{tail}"
        return EndReason.completed, 0, JobState.succeeded, "completed"

    def _infra_failure(self, error: BaseException) -> tuple[EndReason, int | None, JobState, str]:
        cause = error.cause if isinstance(error, ActivityError) else error
        if (isinstance(cause, ApplicationError) and cause.type == AGENT_SHUTDOWN
                and workflow.patched("agent-shutdown-not-counted")):
            # A restart or drain of the agent (stopped with the grace to checkpoint): planned,
            # and no fault of the job's; counting it would fail long jobs over routine upgrades.
            return (EndReason.machine_failure, None, JobState.queued,
                    "requeued: its machine's agent shut down (a restart or drain)")
        if isinstance(cause, ApplicationError) and cause.type in (ATTEMPT_NOT_HERE, ATTEMPT_ABANDONED):
            # Only after a watch again (watch-again-after-lost-heartbeats): nothing left to watch.
            end, why = EndReason.machine_failure, f"its attempt was lost with its heartbeats: {cause.message}"
        elif isinstance(cause, TimeoutError) and cause.type == TimeoutType.SCHEDULE_TO_START:
            end, why = EndReason.not_started, "its machine's agent did not pick the attempt up"
        elif isinstance(cause, TimeoutError) and cause.type == TimeoutType.START_TO_CLOSE:
            end, why = EndReason.machine_failure, f"its attempt ran past {RUN_LIMIT.days} days, the limit of one attempt"
        elif isinstance(cause, TimeoutError):
            end, why = EndReason.machine_failure, "its machine's agent stopped heartbeating"
        else:
            end, why = EndReason.machine_failure, f"the agent failed: {cause}"
        return self._count_infra_failure(end, why)

    def _count_infra_failure(self, end: EndReason, why: str, *, exit_code: int | None = None,
                             lines: str = "") -> tuple[EndReason, int | None, JobState, str]:
        """`exit_code`: the command's, where it exited (75); `lines`: its last log lines, if any."""
        self.counted_infra = True
        if workflow.patched("infra-failures-in-a-row"):
            ran = None if self.attempt_began is None else workflow.now() - self.attempt_began
            self.infra_failures = infra_failures_with(self.infra_failures, ran)
        else:
            self.infra_failures += 1
        tail = f":\n{lines}" if lines else ""
        if self.infra_failures >= MAX_INFRA_FAILURES:
            return end, exit_code, JobState.failed, f"{why} ({self.infra_failures} infrastructure failures){tail}"
        if workflow.patched("infra-failures-held-back"):
            self.held_for = self.infra_failures  # the store holds it back from the second on
        return end, exit_code, JobState.queued, f"requeued: {why}{tail}"

    async def _stop(self, runs) -> None:
        for r in runs:
            if not r.done():
                r.cancel()
        # Each cancelled run ends once its agent has stopped the process (or its heartbeat lapses).
        await asyncio.gather(*runs, return_exceptions=True)

    async def _end(self, allocation_id: int | None, end: EndReason, exit_code: int | None,
                   next_state: JobState, reason: str) -> None:
        await workflow.execute_activity(
            "end_attempt",
            EndAttempt(job_id=self.job_id, allocation_id=allocation_id, end_reason=end, exit_code=exit_code,
                       next_state=next_state, reason=reason, machine_id=self.failed_host,
                       unusable_checkpoint=self.unusable_checkpoint, failures_in_a_row=self.held_for),
            **STORE_CALL,
        )
        self.unusable_checkpoint = None
        self.held_for = 0
        self.state = next_state
        self.exit_code = exit_code if next_state.terminal else None
        self.reason = reason
        self._publish()

    async def _wake(self, reason: str) -> None:
        # Best effort and quick: the scheduler also plans on its tick, so a wake that cannot get
        # through only delays the next cycle; it must never hold up the job's own progress.
        try:
            await workflow.execute_activity(
                "wake_scheduler", Wake(cluster=self.cluster, reason=reason),
                start_to_close_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_attempts=3))
        except ActivityError as e:
            workflow.logger.warning("could not wake the scheduler of %s: %s", self.cluster, e.cause)

    def _state_attribute(self) -> str:
        # Not behind workflow.patched: a replay does not compare upserted values, so a workflow
        # from before (lowercase) replays as it ran and writes the new spelling from then on,
        # where a patch would keep its first answer, lowercase, for the whole run.
        return self.state.attribute

    def _publish(self) -> None:
        req = self.request
        workflow.upsert_search_attributes([
            SearchAttributePair(JOB_STATE, self._state_attribute()),
            SearchAttributePair(TEAM, req.team),
            SearchAttributePair(PRIORITY_CLASS, Priority(req.priority).value),
            SearchAttributePair(CLUSTER, self.cluster or ""),
            SearchAttributePair(GPU_COUNT, req.num_gpus),
        ])


def _retries(n: int) -> str:
    return "retry" if n == 1 else f"{n} retries"


def _heartbeats_lost(run) -> bool:
    """Whether a run's watch ended because the server heard no heartbeat of it in time."""
    if not run.done() or run.cancelled() or run.exception() is None:
        return False
    cause = run.exception().cause if isinstance(run.exception(), ActivityError) else None
    return isinstance(cause, TimeoutError) and cause.type == TimeoutType.HEARTBEAT


def _result_of(run) -> RunJobResult | None:
    """A run's result, if it ended with one (not cancelled, not failed)."""
    if not run.done() or run.cancelled() or run.exception() is not None:
        return None
    return run.result()


def _ended_on_its_own(run) -> bool:
    """Whether a stopped run had already succeeded by itself (the agent answers with the result)."""
    result = _result_of(run)
    return result is not None and result.exit_code == 0 and not result.stopped
