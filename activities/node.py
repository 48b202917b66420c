"""What an agent does on its machine: run one attempt of a job, pinned to its GPUs, and stop it.

``NodeActivities.run_job`` is the activity a ``JobWorkflow`` runs on ``agent_task_queue(M)``. It
starts the job's command in its own process group, heartbeats while it runs, and returns how it
ended. The instance holds the machine's live processes, so the agent can also list them and kill
the ones whose allocation the scheduler no longer holds (orphans).

The job's environment: the agent's own, less its ``GPUSCHED_*`` settings (database DSN, API
token: a job has no business with them; the checkpoint store's endpoint and credentials are
passed back when the job has a checkpoint URI), plus ``RunJobInput.env``, plus these (which win):

| variable                  | value                                                          |
|---------------------------|----------------------------------------------------------------|
| CUDA_VISIBLE_DEVICES      | the granted GPU indices, comma-separated, in grant order       |
| CUDA_DEVICE_ORDER         | PCI_BUS_ID, so CUDA numbers GPUs as NVML (and the agent) does  |
| GPUSCHED_JOB_ID           | the job id                                                     |
| GPUSCHED_ALLOCATION_ID    | the allocation: the fencing token of a checkpoint commit      |
| GPUSCHED_ATTEMPT          | 1 for the first run, +1 for each resume                        |
| GPUSCHED_MACHINE_ID       | this machine, e.g. c1/b0/r0/m0                                 |
| GPUSCHED_GPUS             | the granted GPUs' topology paths, space-separated              |
| GPUSCHED_NUM_GPUS         | how many GPUs were granted here                                |
| GPUSCHED_CHECKPOINT_URI   | where to write checkpoints (a prefix); unset when none         |
| GPUSCHED_RESUME_FROM      | the complete checkpoint to resume from; unset on a fresh start |
| GPUSCHED_RESUME_SEQ       | its sequence number                                            |
| GPUSCHED_RESUME_SHA256    | the digest the control plane committed for it                 |
| GPUSCHED_CHECKPOINT_INTERVAL, GPUSCHED_CHECKPOINT_PHASE | when to checkpoint (staggered)   |
| GPUSCHED_REPORT_DIR       | where the job reports checkpoints it wrote (see below)         |
| GPUSCHED_LAUNCHED_AT      | the epoch time the agent started the process                   |
| GPUSCHED_S3_*             | the checkpoint store's endpoint and credentials, when it has a checkpoint URI |
| GPUSCHED_GRACE_PERIOD     | seconds from SIGTERM to SIGKILL, as launched (a stop order's own: stop.json) |
| GPUSCHED_LOG              | this attempt's log file                                        |
| GPUSCHED_RUN_TOKEN        | a random value marking this run's processes, wherever they go  |

Checkpoint reports: the job (through ``jobkit``) writes ``checkpoint-<seq>.json`` into its report
directory after writing the bytes; the agent forwards each report to the control plane with the
attempt's allocation id (the fencing token: the job cannot choose it) and writes the answer to
``checkpoint-<seq>.ack.json``. Reports are forwarded while the job runs and again after it
exits, before the activity returns (for up to a minute while the control plane cannot be
reached), so a checkpoint taken in the grace period is committed before the allocation ends. A
resumed job's ``restored.json`` (how long it took from its launch to its state restored) is
forwarded once, with the same allocation id: the control plane learns restart times from it.
A job that found its resume checkpoint unusable (``unusable.json``: gone, corrupted) has the
reason in its result (``resume_unusable``), which the attempt's end takes to the control plane.

A job that dies on a failing GPU: when a run exits non-zero (not stopped by us), the agent reads
its GPUs' health at once (``gpu_faults``). A GPU of the run with a fault that can kill a process
(``workers.devices.kills_processes``: an XID, uncorrectable ECC errors, fallen off the bus, NVML
failing; not throttling, nor XIDs 63 and 92, which only record) is named in the result's
``gpu_faults``, and the workflow requeues the job as a machine failure: a CUDA process usually
dies of such a fault before any heartbeat reports it.

Logs: with ``max_log_bytes`` (the agent's ``--max-log-mb``), an attempt's log that grows past it
is cut back to its last part (16 MiB at most) every few seconds, after a line saying how much was
dropped, so a job that prints without end cannot fill the machine's disk.

Stopping: SIGTERM to the whole process group, ``grace_period`` seconds for every process of the
group to exit (a job checkpoints here), then SIGKILL to the group. A job that ends on its own
has any processes it left behind in its group killed at once, so nothing keeps holding the GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Awaitable, Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from activities import run_processes
from activities.run_processes import (POLL, RUN_TOKEN, RunProcesses, boot_id, group_to_signal, new_token, start_ticks,
                                      tell_grace)
from jobkit import RESTORED_REPORT, UNUSABLE_REPORT
from workflows.types import (AGENT_SHUTDOWN, ATTEMPT_ABANDONED, ATTEMPT_NOT_HERE, EXIT_STOPPED, SIGTERM, AttachOrder,
                             RunJobInput, RunJobResult, StopOrder)

log = logging.getLogger("gpusched.node")
SERVER_GAVE_UP = "ServerGaveUp"  # the error a watch the server gave up on ends with (nobody receives it)

# (job id, allocation id, report) → the control plane's answer {"committed": bool, "reason": str}
ReportSink = Callable[[str, int, dict], Awaitable[dict]]
# GPU indices → the faults those GPUs show now that could kill a process on them ("GPU 3: xid:79")
GpuFaultSource = Callable[[list[int]], Awaitable[list[str]]]
REPORT_EVERY = 0.2  # seconds between looks into a running job's report directory

TAIL_LINES = 20
_TAIL_BYTES = 64 * 1024
_LINE_CHARS = 2000  # a progress bar redrawn with \r is one endless line

AGENT_FAULT = "AgentFault"  # the ApplicationError type when the machine, not the job, fails a start
FINAL_FORWARD_FOR = 60.0  # seconds to keep trying to forward a stopped job's last reports
# A job that a SIGTERM not ours ended waits this long for the agent's own shutdown: a machine
# shutting down, or a service stopped with its jobs (systemd's KillMode=control-group), SIGTERMs
# the agent at the same moment, and the job is no more at fault than for any other stop.
SHUTDOWN_FOLLOWS = 2.0
# How long a process whose watch timed out runs on for the workflow to watch it again: the
# workflow hears of the timeout when the server is back, asks the control plane whether it heard
# this machine meanwhile, and attaches (seconds, if the control worker is up).
REATTACH_WAIT = 60.0
LOG_CHECK_EVERY = 5.0  # seconds between looks at a running job's log size
LOG_KEEP = 16 * 1024 * 1024  # what a log cut back keeps of its end, at most
MAX_UNUSABLE_REASON = 1000  # characters of a job's word on why its resume checkpoint is unusable
FORWARD_BEFORE_STOP_S = 3.0  # an earlier agent's process waits this long at most for its reports to go


def job_env(req: RunJobInput, machine_id: str, log_path: Path,
            base: dict[str, str] | None = None, checkpoint_env: dict[str, str] | None = None,
            report_dir: Path | None = None, launched_at: float | None = None,
            run_token: str | None = None) -> dict[str, str]:
    """The environment of the job's process (see the module's table)."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith("GPUSCHED_")}
    env.update(req.env)
    env.update({
        "CUDA_VISIBLE_DEVICES": ",".join(str(g.index) for g in req.gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUSCHED_JOB_ID": req.job_id,
        "GPUSCHED_ALLOCATION_ID": str(req.allocation_id),
        "GPUSCHED_ATTEMPT": str(req.attempt),
        "GPUSCHED_MACHINE_ID": machine_id,
        "GPUSCHED_GPUS": " ".join(g.path for g in req.gpus),
        "GPUSCHED_NUM_GPUS": str(len(req.gpus)),
        "GPUSCHED_GRACE_PERIOD": f"{req.grace_period:g}",
        "GPUSCHED_LOG": str(log_path),
    })
    if req.checkpoint_uri:
        env.update(checkpoint_env or {})
    optional = {
        "GPUSCHED_CHECKPOINT_URI": req.checkpoint_uri,
        "GPUSCHED_RESUME_FROM": req.resume_from,
        "GPUSCHED_RESUME_SEQ": None if req.resume_seq is None else str(req.resume_seq),
        "GPUSCHED_RESUME_SHA256": req.resume_sha256,
        "GPUSCHED_CHECKPOINT_INTERVAL": f"{req.checkpoint_interval:g}" if req.checkpoint_interval else None,
        "GPUSCHED_CHECKPOINT_PHASE": None if req.checkpoint_phase is None else f"{req.checkpoint_phase:g}",
        "GPUSCHED_REPORT_DIR": str(report_dir) if report_dir is not None else None,
        "GPUSCHED_LAUNCHED_AT": None if launched_at is None else f"{launched_at:.3f}",
        RUN_TOKEN: run_token,
    }
    for var, value in optional.items():
        if value:
            env[var] = value
        else:
            env.pop(var, None)  # even if req.env set it: unset means "none", documented
    return env


_run_numbers = itertools.count()


@dataclass(eq=False)
class _Run:
    """One allocation's process on this machine, shared by every activity attached to it."""

    req: RunJobInput
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    body_offset: int = 0  # where the job's own output starts in the log (after our header)
    outcome: asyncio.Task | None = None  # → RunJobResult once the process group is gone
    stop_deadline: float | None = None  # loop time of the SIGKILL, once a stop is asked
    ordered_stop: bool = False  # the scheduler's stop order set the deadline (stop_job)
    stopper: asyncio.Task | None = None
    spawned: asyncio.Event = field(default_factory=asyncio.Event)  # started, or failed to
    token: str = field(default_factory=new_token)  # GPUSCHED_RUN_TOKEN: marks all its processes
    members: RunProcesses | None = None  # once started
    number: int = field(default_factory=lambda: next(_run_numbers))  # in the order runs were asked for
    watchers: int = 0  # activities watching it now (run_job, attach_job)
    abandoned: bool = False  # stopped by the agent because the server gave up on every watch

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


def pid_dir(log_dir: Path, machine_id: str) -> Path:
    """Where an agent of the machine records the process groups of its runs."""
    return log_dir / ".pids" / machine_id.strip("/").replace("/", "-")


class NodeActivities:
    """The node activities of one machine (``run_job``) and the state of its live processes."""

    def __init__(self, machine_id: str, log_dir: Path, heartbeat_every: float = 1.0,
                 shutdown_grace: float | None = None, remember_finished: int = 1024,
                 report_sink: ReportSink | None = None, checkpoint_env: dict[str, str] | None = None,
                 restart_sink: ReportSink | None = None, final_forward_for: float = FINAL_FORWARD_FOR,
                 gpu_faults: GpuFaultSource | None = None, max_log_bytes: int | None = None,
                 log_check_every: float = LOG_CHECK_EVERY, reattach_wait: float = REATTACH_WAIT,
                 shutdown_follows: float = SHUTDOWN_FOLLOWS):
        self.machine_id = machine_id
        self.reattach_wait = reattach_wait
        self.shutdown_follows = shutdown_follows
        # Workflow id → whether it runs (None: cannot tell); set by the agent once it has a
        # Temporal client. Unset: every workflow may still watch again.
        self.workflow_running: Callable[[str], Awaitable[bool | None]] | None = None
        # An attempt's log past this is cut back to its end, so a chatty job cannot fill the disk.
        self.max_log_bytes = max_log_bytes
        self.log_check_every = log_check_every
        # Asked when a run fails: whether one of its GPUs is failing (None: never asked).
        self.gpu_faults = gpu_faults
        # Where checkpoint reports and restart times go (the control plane), and what a job needs
        # to write to the checkpoint store (endpoint and credentials), given to jobs that checkpoint.
        self.report_sink = report_sink
        self.restart_sink = restart_sink
        self.checkpoint_env = checkpoint_env or {}
        self.final_forward_for = final_forward_for
        self.log_dir = Path(log_dir)
        self.heartbeat_every = heartbeat_every
        # The most a job's grace may be when the agent shuts down: the worker's own graceful
        # shutdown timeout must cover it, or the job outlives its watcher.
        self.shutdown_grace = shutdown_grace
        self.processes: dict[int, _Run] = {}
        # Results of recently ended allocations: a retry of an activity whose first attempt the
        # server gave up on (agent partitioned) gets the real result instead of a second run.
        self.finished: OrderedDict[int, RunJobResult] = OrderedDict()
        self.abandoned: set[int] = set()  # of those, the runs stopped because nobody watched them
        # Ended runs whose processes outlived SIGKILL and its wait (stuck in the kernel: a hung
        # file system, the driver): (their processes, their GPU indices). Their GPUs are
        # reported sick until they are gone, so no job is placed beside them.
        self.lingering: dict[int, tuple[RunProcesses, list[int]]] = {}
        self._unforwarded: set[Path] = set()  # reports already said to be unforwardable
        self._restarts_sent: set[Path] = set()  # report folders whose restart time was sent
        self.remember_finished = remember_finished
        # One directory per machine: the dev stack runs many agents over one log directory,
        # and an agent must reap only what an earlier agent *of its machine* left.
        self.pid_dir = pid_dir(self.log_dir, machine_id)

    # -- the activity -----------------------------------------------------------------------

    @activity.defn(name="run_job")
    async def run_job(self, req: RunJobInput) -> RunJobResult:
        """Run the attempt, or attach to it if this allocation's process is already running.

        Cancellation (the workflow preempts or cancels the job): stop with grace, then re-raise;
        a job that had already ended on its own returns its result instead, so a success is
        not taken for a stop. Cancellation because the server gave up on this attempt (timed
        out, or not found: what a server back from an outage says of a watch it timed out):
        unless Temporal says the workflow has ended (terminated), the process keeps running for
        ``reattach_wait`` seconds for the workflow to watch it again (``attach_job``), which it
        does when the control plane heard this machine all along; if no watch comes, the
        workflow has ended, or the agent shuts down (no watch can come), stop with grace. A
        paused attempt keeps running. Worker shutdown: stop with grace (the shutdown's at most),
        then fail with the non-retryable ``AgentShutdown`` so the workflow requeues the job."""
        alloc = req.allocation_id
        if alloc in self.finished:
            return self.finished[alloc]
        run = self.processes.get(alloc)
        if run is None:
            if activity.is_worker_shutdown():
                raise ApplicationError(f"agent of {self.machine_id} is shutting down",
                                       type=AGENT_SHUTDOWN, non_retryable=True,
                                       category=ApplicationErrorCategory.BENIGN)
            # Registered before the first await, so a duplicate arriving meanwhile attaches.
            run = _Run(req=req, log_path=self._log_path(req))
            self.processes[alloc] = run
            run.outcome = asyncio.create_task(self._execute(run))
        else:
            log.info("allocation %d: attaching to its running process (pid %s)", alloc, run.pid)
        return await self._watch(run)

    @activity.defn(name="attach_job")
    async def attach_job(self, order: AttachOrder) -> RunJobResult:
        """Watch an attempt that runs here again, as ``run_job`` does, after the server gave up on
        the first watch; never starts a process. Fails (non-retryable) when there is nothing to
        watch: no such process (this agent restarted since: the earlier one's processes were
        reaped; or the server handed the task out as Temporal died and it never arrived), or one
        this agent stopped because nobody watched it again in time."""
        alloc = order.allocation_id
        run = self.processes.get(alloc)
        if run is None and alloc not in self.finished:
            raise ApplicationError(f"agent of {self.machine_id} runs no process of allocation {alloc} "
                                   "(the agent restarted since, or its task was lost with Temporal)",
                                   type=ATTEMPT_NOT_HERE, non_retryable=True,
                                   category=ApplicationErrorCategory.BENIGN)
        if run is not None:
            log.info("allocation %d: watched again (pid %s)", alloc, run.pid)
            result = await self._watch(run)
        else:
            result = self.finished[alloc]
        if alloc in self.abandoned:
            raise ApplicationError(
                f"agent of {self.machine_id} stopped the job: the server had given up on its attempt and "
                f"nobody watched it again within {self.reattach_wait:g} s", result.model_dump(mode="json"),
                type=ATTEMPT_ABANDONED, non_retryable=True, category=ApplicationErrorCategory.BENIGN)
        return result

    async def _watch(self, run: _Run) -> RunJobResult:
        """Heartbeat while the run lives and return how it ended; stop it as the activity's
        cancellation or the worker's shutdown asks (run_job says how)."""
        alloc, req = run.req.allocation_id, run.req
        workflow_id = activity.info().workflow_id
        run.watchers += 1
        shutdown = asyncio.create_task(activity.wait_for_worker_shutdown())
        try:
            # The first heartbeat carries the pid; spawning takes milliseconds.
            try:
                await asyncio.wait_for(run.spawned.wait(), timeout=self.heartbeat_every)
            except TimeoutError:
                pass
            while True:
                activity.heartbeat({"pid": run.pid, "allocation_id": alloc})
                done, _ = await asyncio.wait((run.outcome, shutdown), timeout=self.heartbeat_every,
                                             return_when=asyncio.FIRST_COMPLETED)
                if run.outcome in done:
                    result = run.outcome.result()
                    if _ended_by_sigterm(result):
                        # Not our SIGTERM: whether ours (our own shutdown) follows tells the
                        # machine's stop from the command's own end (exit 143 of itself).
                        await asyncio.wait((shutdown,), timeout=self.shutdown_follows)
                        if shutdown.done():
                            log.info("allocation %d: ended by the SIGTERM that stops this agent", alloc)
                            raise self._shut_down(result)
                    return result
                if shutdown in done:
                    # A job that exited on its own before the shutdown (its last reports still
                    # being forwarded) keeps its result: run again, a finished job repeats its work.
                    # Unless the SIGTERM that stops us ended it too.
                    ended_before = run.process is not None and run.process.returncode is not None
                    if not ended_before:
                        grace = self._grace(req)
                        log.info("allocation %d: agent shutting down, stopping the job (%gs grace)",
                                 alloc, grace)
                        self._request_stop(run, grace)
                    result = await self._stopped(run, heartbeat=True)
                    if ended_before and run.stopper is None and not _ended_by_sigterm(result):
                        return result
                    raise self._shut_down(result)
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if details is not None and details.paused:
                log.warning("allocation %d: activity paused; the process keeps running", alloc)
                raise
            if _forgotten(details) and await self._workflow_may_watch_again(workflow_id):
                # A server back from an outage answers "not found" for a watch it timed out, as
                # for one of a workflow that is gone: only the workflow's status tells them apart.
                log.warning("allocation %d: the server gave up on this watch (%s); the process runs on "
                            "for %gs for the workflow to watch it again", alloc, details, self.reattach_wait)
                if await self._watched_again(run):
                    log.info("allocation %d: watched again; this watch ends", alloc)
                    raise _server_gave_up(alloc, "another activity watches the job now") from None
            grace = self._grace(req)
            if _forgotten(details):
                log.warning("allocation %d: the server gave up on this attempt (%s); stopping "
                            "it with %gs grace", alloc, details, grace)
            else:
                log.info("allocation %d: cancelled, stopping with %gs grace", alloc, grace)
            ended_before = run.outcome.done() or (run.process is not None and run.process.returncode is not None)
            if _forgotten(details) and not ended_before and run.stopper is None:
                run.abandoned = True
            if not run.ordered_stop:  # the order's grace stands over the one launched with
                self._request_stop(run, grace)
            # An attempt the server has given up on takes no heartbeats.
            result = await self._stopped(run, heartbeat=not _forgotten(details))
            if ended_before and run.stopper is None:
                return result  # it ended on its own before the stop: its own result stands
            if _forgotten(details):
                raise _server_gave_up(alloc, "the job was stopped") from None
            raise
        finally:
            run.watchers -= 1
            shutdown.cancel()

    def _shut_down(self, result: RunJobResult) -> ApplicationError:
        """The attempt's end as the agent shuts down: requeued by the workflow, not counted."""
        return ApplicationError(
            f"agent of {self.machine_id} shut down; the job was stopped",
            result.model_dump(mode="json"), type=AGENT_SHUTDOWN, non_retryable=True,
            category=ApplicationErrorCategory.BENIGN)  # expected: no traceback in logs

    def _grace(self, req: RunJobInput) -> float:
        """The grace a stop gives the job now: the one it was launched with, at most the
        shutdown's while the agent shuts down (its supervisor waits no longer)."""
        if activity.is_worker_shutdown() and self.shutdown_grace is not None:
            return min(req.grace_period, self.shutdown_grace)
        return req.grace_period

    async def _workflow_may_watch_again(self, workflow_id: str | None) -> bool:
        """Unless the workflow is known to have ended (terminated, say), it may watch again."""
        if self.workflow_running is None or workflow_id is None:
            return True
        try:
            return await self.workflow_running(workflow_id) is not False
        except asyncio.CancelledError:
            return True

    async def _watched_again(self, run: _Run) -> bool:
        """Whether another activity watches the run within ``reattach_wait`` (False as soon as
        the run ends: its result waits in ``finished`` for whoever watches next)."""
        deadline = asyncio.get_running_loop().time() + self.reattach_wait
        while asyncio.get_running_loop().time() < deadline and not run.outcome.done():
            if run.watchers > 1:
                return True
            if activity.is_worker_shutdown():
                return False  # the worker polls no more: no watch can come
            try:
                await asyncio.sleep(POLL)
            except asyncio.CancelledError:
                continue  # the server's word was said once; this is the agent's wait
        return run.watchers > 1 and not run.outcome.done()

    async def _stopped(self, run: _Run, *, heartbeat: bool) -> RunJobResult:
        """The result of a run being stopped, once its process has checkpointed and exited.

        Heartbeats meanwhile: the server holds an activity it has asked to cancel to its
        heartbeat timeout too, and would end the attempt after it (giving the GPUs to the next
        job) while the job still checkpoints in its grace period. A second cancel changes
        nothing: the stop is already under way, and only its end may end the activity."""
        while True:
            if heartbeat:
                activity.heartbeat({"pid": run.pid, "allocation_id": run.req.allocation_id})
            try:
                done, _ = await asyncio.wait((run.outcome,), timeout=self.heartbeat_every)
            except asyncio.CancelledError:
                continue
            if done:
                return run.outcome.result()

    # -- what the agent uses ----------------------------------------------------------------

    def live_allocations(self) -> list[int]:
        return sorted(self.processes)

    def lingering_gpus(self) -> set[int]:
        """The GPUs of ended runs whose processes are still alive; forgets those now gone."""
        gpus: set[int] = set()
        for alloc, (members, indices) in list(self.lingering.items()):
            if members.alive():
                gpus.update(indices)
                continue
            del self.lingering[alloc]
            log.info("allocation %d: the processes that outlived SIGKILL are gone; GPUs %s are free again",
                     alloc, ",".join(map(str, indices)))
            self._forget_pid_file(alloc)
        return gpus

    def _forget_pid_file(self, alloc: int) -> None:
        try:
            (self.pid_dir / f"{alloc}.json").unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot remove pid file of allocation %d: %s", alloc, err)

    @activity.defn(name="stop_job")
    async def stop_job(self, order: StopOrder) -> bool:
        """Stop an attempt with the grace the scheduler ordered; False if it is not running here.

        The workflow sends it just before it cancels ``run_job``, in either order of arrival:
        the grace the attempt was launched with may be out of date (the cluster's grace period
        changed since) or not apply (a gang that lost a machine is given none), and the
        scheduler plans the GPUs free when the order's grace ends."""
        run = self.processes.get(order.allocation_id)
        if run is None or run.outcome is None or run.outcome.done():
            return False
        log.info("allocation %d: stop ordered (%s), %gs grace", order.allocation_id, order.reason,
                 order.grace_period)
        self._request_stop(run, order.grace_period, ordered=True)
        return True

    def _tell_stop_order(self, run: _Run, grace: float) -> None:
        """Tell the job the grace it really has (jobkit's stop.json), before SIGTERM where the
        stop comes first; its GPUSCHED_GRACE_PERIOD is the launch's. Every stop says it: the
        scheduler's order, the agent's shutdown (its own grace at most), an orphan's kill."""
        tell_grace(self._report_dir(run.req), grace, run.req.allocation_id)

    async def kill_allocation(self, allocation_id: int, grace: float) -> RunJobResult | None:
        """Stop an allocation's process (SIGTERM, ``grace``, SIGKILL); None if it has none."""
        run = self.processes.get(allocation_id)
        if run is None:
            return None
        self._request_stop(run, grace)
        return await asyncio.shield(run.outcome)

    async def stop_all(self, grace: float) -> None:
        runs = list(self.processes.values())
        for run in runs:
            self._request_stop(run, grace)
        await asyncio.gather(*(asyncio.shield(r.outcome) for r in runs), return_exceptions=True)

    def kill_all_now(self) -> None:
        """SIGKILL every live process group: the agent is exiting and nothing would watch them."""
        for run in self.processes.values():
            if run.members is not None:
                run.members.signal(signal.SIGKILL)

    async def reap_leftovers(self, grace: float) -> list[int]:
        """Stop the process groups an earlier agent of this machine left running (it was
        killed without a chance to stop them). Call before serving. Returns their allocations.
        All at once: each may wait its grace and up to ``final_forward_for`` for the control
        plane, and one after the other they kept a machine of eight jobs from serving for minutes."""
        files = sorted(self.pid_dir.glob("*.json")) if self.pid_dir.exists() else []
        reaped = await asyncio.gather(*(self._reap(pid_file, grace) for pid_file in files))
        return [alloc for alloc in reaped if alloc is not None]

    async def _reap(self, pid_file: Path, grace: float) -> int | None:
        """Stop one left process group (its allocation, or None if it was gone) and forward its reports."""
        try:
            info = json.loads(pid_file.read_text())
            pgid, alloc = int(info["pid"]), int(info["allocation_id"])
            gpus = [int(g) for g in info.get("gpus", [])]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring bad pid file %s: %s", pid_file, err)
            pid_file.unlink(missing_ok=True)
            return None
        reaped = None
        # A pid now another process's leaves only the processes carrying the run's token.
        left = RunProcesses(group_to_signal(info), info.get("token"))
        if left.alive():
            if info.get("report_dir") and info.get("job_id"):
                # What it saved while no agent listened, first: its allocation may still be the
                # job's current one now, and not by the time the stop below is done.
                await self._forward_before_stop(info["job_id"], alloc, Path(info["report_dir"]))
            log.warning("allocation %d: stopping process group %d left by an earlier agent (%gs grace)",
                        alloc, pgid, grace)
            # Its GPUSCHED_GRACE_PERIOD is the launch's: told nothing, jobkit planned a save for
            # that and was killed in the middle of it.
            tell_grace(info.get("report_dir"), grace, alloc)
            left.signal(signal.SIGTERM)
            deadline = asyncio.get_running_loop().time() + grace
            while left.alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(POLL)
            left.signal(signal.SIGKILL)
            await left.gone()
            reaped = alloc
            if left.alive():
                # Stuck in the kernel, as it was for the agent before: its GPUs stay reported sick
                # while it lingers, and its pid file stays for the next agent (lingering_gpus).
                self.lingering[alloc] = (left, gpus)
                log.error("allocation %d: processes left by an earlier agent outlived SIGKILL; GPUs %s are "
                          "reported sick until they are gone", alloc, ",".join(map(str, gpus)) or "(not recorded)")
        if info.get("report_dir") and info.get("job_id"):
            # What the orphan reported while nobody listened: the control plane decides (a
            # revoked allocation's checkpoints are refused: a zombie writer). Tried again
            # while the control plane is unreachable (the agents of a restarted stack come
            # up first): nothing forwards them later.
            await self._forward_last(info["job_id"], alloc, Path(info["report_dir"]))
        if alloc not in self.lingering:
            pid_file.unlink(missing_ok=True)
        return reaped

    # -- one run ----------------------------------------------------------------------------

    def live_job_dirs(self) -> set[Path]:
        """The log folders of the jobs running here now."""
        return {self._log_path(run.req).parent for run in self.processes.values()}

    def prune_logs(self, older_than: float, running: set[Path]) -> int:
        """Delete the attempt logs and report folders untouched for ``older_than`` seconds, but
        those of the jobs ``running`` here; returns how many went. Each attempt keeps up to a
        log's cap (--max-log-mb) for ever otherwise, and a busy machine runs thousands. Safe in
        a thread: it reads no live state."""
        cutoff = time.time() - older_than
        pruned = 0
        for job_dir in self.log_dir.iterdir() if self.log_dir.is_dir() else ():
            if job_dir.name.startswith(".") or not job_dir.is_dir() or job_dir in running:
                continue
            for entry in list(job_dir.iterdir()):
                try:
                    if entry.stat().st_mtime >= cutoff:
                        continue
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                    pruned += 1
                except OSError as err:
                    log.warning("cannot prune %s: %s", entry, err)
            try:
                job_dir.rmdir()  # only once empty
            except OSError:
                pass
        return pruned

    def _log_path(self, req: RunJobInput) -> Path:
        safe_job = req.job_id.replace("/", "_").lstrip(".") or "job"
        return self.log_dir / safe_job / f"attempt-{req.attempt}.log"

    def _report_dir(self, req: RunJobInput) -> Path:
        return self._log_path(req).parent / f"reports-{req.attempt}"

    # -- checkpoint reports -----------------------------------------------------------------

    async def forward_reports(self, job_id: str, allocation_id: int, report_dir: Path) -> int:
        """Forward each report not answered yet; returns how many were answered."""
        if self.report_sink is None or not report_dir.is_dir():
            return 0
        answered = 0
        for report_file, ack_file in _unanswered(report_dir):
            try:
                report = json.loads(report_file.read_text())
                if not isinstance(report, dict):
                    raise ValueError(f"a report is a JSON object, not {type(report).__name__}")
            except (OSError, ValueError) as err:
                # Answered here, so the job hears of it and nobody waits for an answer to it.
                log.warning("allocation %d: unreadable report %s: %s", allocation_id, report_file, err)
                _write_ack(ack_file, {"committed": False, "reason": f"the agent cannot read this report: {err}"})
                continue
            try:
                answer = await self.report_sink(job_id, allocation_id, report)
            except Exception as err:  # the control plane is unreachable: try again next time
                # Said once per report, not every 0.2 s it is tried again.
                (log.debug if report_file in self._unforwarded else log.warning)(
                    "allocation %d: cannot forward %s: %s (trying again)", allocation_id, report_file.name, err)
                self._unforwarded.add(report_file)
                continue
            self._unforwarded.discard(report_file)
            _write_ack(ack_file, answer)
            answered += 1
            log.info("allocation %d: checkpoint %s %s%s", allocation_id, report.get("seq"),
                     "committed" if answer.get("committed") else "refused",
                     "" if answer.get("committed") else f": {answer.get('reason')}")
        await self._forward_restart(job_id, allocation_id, report_dir)
        return answered

    async def _forward_restart(self, job_id: str, allocation_id: int, report_dir: Path) -> None:
        """Forward the job's restart time (``restored.json``) once; a failure is tried again."""
        report_file, sent = report_dir / RESTORED_REPORT, report_dir / (RESTORED_REPORT + ".sent")
        if self.restart_sink is None or report_dir in self._restarts_sent or sent.exists() or not report_file.exists():
            return
        try:
            report = json.loads(report_file.read_text())
            float(report["seconds"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("allocation %d: unreadable restart report %s: %s", allocation_id, report_file, err)
            return
        try:
            await self.restart_sink(job_id, allocation_id, report)
        except Exception as err:  # the control plane is unreachable: try again next time
            log.warning("allocation %d: cannot forward its restart time: %s", allocation_id, err)
            return
        self._restarts_sent.add(report_dir)  # the marker below is for an agent started after this one
        try:
            sent.touch()
        except OSError as err:  # a full disk: never a failed run (a later agent sends it again; the first counts)
            log.warning("allocation %d: cannot mark its restart time sent: %s", allocation_id, err)
        log.info("allocation %d: restored in %.1f s", allocation_id, float(report["seconds"]))

    async def _forward_before_stop(self, job_id: str, allocation_id: int, report_dir: Path) -> None:
        """One quick try at forwarding an orphan's reports before it is stopped: a control plane
        that does not answer at once must not keep a process on GPUs another job may be given."""
        try:
            await asyncio.wait_for(self.forward_reports(job_id, allocation_id, report_dir), FORWARD_BEFORE_STOP_S)
        except asyncio.TimeoutError:
            log.warning("allocation %d: no answer to its reports in %g s; stopping it first", allocation_id,
                        FORWARD_BEFORE_STOP_S)
        except Exception as err:  # noqa: BLE001 - best effort: forwarded again after the stop
            log.warning("allocation %d: could not forward its reports before stopping it: %s", allocation_id, err)

    async def _forward_last(self, job_id: str, allocation_id: int, report_dir: Path) -> None:
        """Forward what is left after the job exited, trying again while the control plane is
        unreachable (for up to ``final_forward_for`` seconds): nothing forwards it later, and a
        checkpoint taken in the grace period is the one the next attempt should resume from."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.final_forward_for
        pause = 0.25
        while True:
            # Each report waits its own answer: a control plane that takes connections and never
            # answers held the attempt's end (and its GPUs) a request timeout per report.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.forward_reports(job_id, allocation_id, report_dir),
                                       max(0.0, give_up - loop.time()))
            left = _unanswered(report_dir)
            if not left or self.report_sink is None:
                return
            if loop.time() + pause > give_up:
                log.warning("allocation %d: giving up on forwarding %s after %.0f s", allocation_id,
                            ", ".join(f.name for f, _ in left), self.final_forward_for)
                self._unforwarded.difference_update(f for f, _ in left)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)

    async def _forward_while_running(self, run: _Run) -> None:
        report_dir = self._report_dir(run.req)
        loop = asyncio.get_running_loop()
        next_log_check = loop.time() + self.log_check_every
        while True:
            try:
                await self.forward_reports(run.req.job_id, run.req.allocation_id, report_dir)
            except Exception:  # noqa: BLE001 - one bad report must not end forwarding and the log cap
                log.exception("allocation %d: forwarding its reports failed; trying again", run.req.allocation_id)
            if self.max_log_bytes is not None and loop.time() >= next_log_check:
                next_log_check = loop.time() + self.log_check_every
                self._cap_log(run)
            await asyncio.sleep(REPORT_EVERY)

    def _cap_log(self, run: _Run) -> None:
        try:
            dropped = _cut_log(run.log_path, self.max_log_bytes)
        except OSError as err:
            log.warning("allocation %d: cannot cut its log back: %s", run.req.allocation_id, err)
            return
        if dropped:
            run.body_offset = 0
            log.warning("allocation %d: its log passed %d bytes; the first %d were dropped",
                        run.req.allocation_id, self.max_log_bytes, dropped)

    async def _stop_overlapping(self, run: _Run) -> None:
        """Stop, at once, any earlier attempt still running on one of this run's GPUs: the
        control plane has ended its allocation (it granted the GPUs again), so its checkpoints
        would be refused, and two jobs must never share a GPU."""
        mine = {g.index for g in run.req.gpus}
        # Only runs asked for before this one: two new ones never wait for each other.
        stale = [r for r in self.processes.values()
                 if r.number < run.number and mine & {g.index for g in r.req.gpus}]
        for other in stale:
            log.warning("allocation %d: allocation %d still runs on its GPUs; killing it first",
                        run.req.allocation_id, other.req.allocation_id)
            self._request_stop(other, 0.0)
        await asyncio.gather(*(asyncio.shield(r.outcome) for r in stale), return_exceptions=True)

    async def _execute(self, run: _Run) -> RunJobResult:
        alloc = run.req.allocation_id
        result: RunJobResult | None = None
        try:
            try:
                await self._stop_overlapping(run)
                stuck = {g.index for g in run.req.gpus} & self.lingering_gpus()
                if stuck:
                    # Reported sick from the next heartbeat on, but placed before it: the job goes
                    # back to the queue rather than share a GPU with processes SIGKILL did not end.
                    raise ApplicationError(f"agent of {self.machine_id}: GPUs {sorted(stuck)} are still held by "
                                           "processes that outlived SIGKILL", type=AGENT_FAULT)
                self._prepare(run)
                await self._check_working_dir(run.req)
                run.process = await self._spawn(run)
                run.members = RunProcesses(run.process.pid, run.token)
            except (_CannotExec, ValueError) as err:
                result = self._spawn_failure(run, err)
                return result
            except OSError as err:  # the machine's fault: the job is requeued, not failed
                raise ApplicationError(f"agent of {self.machine_id} cannot start the job: {err}",
                                       type=AGENT_FAULT) from err
            finally:
                run.spawned.set()
            self._write_pid_file(run)
            if run.stop_deadline is not None:  # a stop came while it was starting
                self._request_stop(run, run.stop_deadline - asyncio.get_running_loop().time())
            forwarder = asyncio.create_task(self._forward_while_running(run))
            try:
                returncode = await self._exit_status(run)
            finally:
                forwarder.cancel()
            if run.stopper is not None:
                await run.stopper  # the rest of the group gets its grace too
            elif run.members.alive():
                log.info("allocation %d: killing processes the job left behind",
                         run.req.allocation_id)
                run.members.signal(signal.SIGKILL)
                await run.members.gone()
            # Checkpoints written up to the exit (a stop's included) are committed before the
            # activity returns, and so before the workflow ends the allocation.
            stopped = run.stopper is not None
            gpu_faults = await self._gpu_faults(run) if returncode != 0 and not stopped else []
            await self._forward_last(run.req.job_id, alloc, self._report_dir(run.req))
            result = RunJobResult(
                exit_code=returncode if returncode >= 0 else None,
                signal=-returncode if returncode < 0 else None,
                stopped=stopped,
                log_path=str(run.log_path),
                last_log_lines=_tail(run.log_path, run.body_offset),
                gpu_faults=gpu_faults,
                resume_unusable=_unusable_resume(self._report_dir(run.req), run.req.resume_seq),
            )
            _append(run.log_path, f"# gpusched {_now()} ended: exit_code={result.exit_code} "
                                  f"signal={result.signal} stopped={result.stopped}"
                                  + (f" gpu_faults={','.join(gpu_faults)}" if gpu_faults else "") + "\n")
            log.info("allocation %d: job %s ended (exit %s, signal %s, stopped %s)", alloc,
                     run.req.job_id, result.exit_code, result.signal, result.stopped)
            return result
        finally:
            if result is None and run.members is not None:
                run.members.signal(signal.SIGKILL)  # the watcher itself was cancelled
            self.processes.pop(alloc, None)
            if run.members is not None and run.members.alive():
                # Its pid file stays too: an agent started after this one reaps them.
                gpus = [g.index for g in run.req.gpus]
                self.lingering[alloc] = (run.members, gpus)
                log.error("allocation %d: processes outlived SIGKILL; GPUs %s are reported sick until "
                          "they are gone", alloc, ",".join(map(str, gpus)))
            else:
                self._forget_pid_file(alloc)
            if result is not None:
                self.finished[alloc] = result
                if run.abandoned:
                    self.abandoned.add(alloc)
                while len(self.finished) > self.remember_finished:
                    self.abandoned.discard(self.finished.popitem(last=False)[0])

    async def _gpu_faults(self, run: _Run) -> list[str]:
        """The faults that could have killed the run shown now by its GPUs ("GPU 3: xid:79")."""
        if self.gpu_faults is None:
            return []
        try:
            faults = await self.gpu_faults([g.index for g in run.req.gpus])
        except Exception as err:  # no reading: the exit counts as the job's own
            log.warning("allocation %d: cannot read GPU health after its failure: %s",
                        run.req.allocation_id, err)
            return []
        if faults:
            log.warning("allocation %d: the job died on a failing GPU (%s)", run.req.allocation_id,
                        ", ".join(faults))
        return faults

    def _prepare(self, run: _Run) -> None:
        """The agent's own part of a start: an error here is the machine's, not the job's."""
        if not run.req.command:
            raise ValueError("the job has an empty command")
        run.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._report_dir(run.req).mkdir(exist_ok=True)

    async def _check_working_dir(self, req: RunJobInput) -> None:
        """The job's working directory, looked at off the event loop and for a while at most: a
        hard-mounted NFS home that stops answering would stall every heartbeat of the machine. A
        directory that is not there is the job's to fix (exit 127, said in its log, as for a
        missing program); a mount that fails (a stale handle, I/O errors, a dead FUSE) or hangs is
        the machine's, and the job is queued again."""
        if req.working_dir is None:
            return
        try:
            info = await asyncio.wait_for(asyncio.to_thread(os.stat, req.working_dir), WORKING_DIR_WAIT)
        except asyncio.TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"its working directory did not answer within {WORKING_DIR_WAIT:g} s "
                          "(a hung mount?)", req.working_dir) from None
        except (FileNotFoundError, NotADirectoryError, PermissionError) as err:
            raise _CannotExec(type(err)(err.errno, _working_dir_unusable(self.machine_id, err.strerror),
                                        req.working_dir)) from err
        if not stat.S_ISDIR(info.st_mode):
            raise _CannotExec(NotADirectoryError(errno.ENOTDIR, _working_dir_unusable(self.machine_id, "not a directory"),
                                                 req.working_dir))

    async def _spawn(self, run: _Run) -> asyncio.subprocess.Process:
        req = run.req
        with open(run.log_path, "ab") as out:
            devices = ",".join(str(g.index) for g in req.gpus)
            out.write(
                f"# gpusched {_now()} job={req.job_id} allocation={req.allocation_id} "
                f"attempt={req.attempt} machine={self.machine_id} CUDA_VISIBLE_DEVICES={devices} "
                f"gpus={' '.join(g.path for g in req.gpus)} command={json.dumps(req.command)}\n"
                .encode())
            out.flush()
            run.body_offset = out.tell()
            # The child gets its own copy of the log's descriptor; ours closes right after.
            try:
                process = await asyncio.create_subprocess_exec(
                    *req.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=job_env(req, self.machine_id, run.log_path, checkpoint_env=self.checkpoint_env,
                                report_dir=self._report_dir(req), launched_at=time.time(),
                                run_token=run.token),
                    cwd=req.working_dir, start_new_session=True)
            except OSError as err:
                if err.errno in _COMMAND_ERRNOS:
                    raise _CannotExec(err) from err
                raise
        log.info("allocation %d: started job %s attempt %d as pid %d on GPUs [%s]",
                 req.allocation_id, req.job_id, req.attempt, process.pid, devices)
        return process

    def _spawn_failure(self, run: _Run, err: Exception) -> RunJobResult:
        # 127/126 as a shell says: not found / found but cannot be run. Returned, not raised:
        # retrying a command that does not exist only delays the job's failure.
        if isinstance(err, _CannotExec):
            err = err.error
        code = 127 if isinstance(err, (FileNotFoundError, ValueError)) else 126
        line = f"gpusched: cannot start {json.dumps(run.req.command)}: {err}"
        log.warning("allocation %d: %s", run.req.allocation_id, line)
        _append(run.log_path, line + "\n")
        return RunJobResult(exit_code=code, log_path=str(run.log_path), last_log_lines=[line])

    def _request_stop(self, run: _Run, grace: float, *, ordered: bool = False) -> None:
        """SIGTERM now and SIGKILL ``grace`` seconds later; a later request may only shorten the
        grace (an orphan kill after a preemption), except the scheduler's order (``ordered``),
        which sets it either way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if ordered or run.stop_deadline is None or deadline < run.stop_deadline:
            run.stop_deadline = deadline
            if run.outcome is None or not run.outcome.done():
                self._tell_stop_order(run, max(0.0, grace))
        run.ordered_stop = run.ordered_stop or ordered
        if run.process is None or run.process.returncode is not None or run.stopper is not None:
            return  # not started yet (_execute stops it when it is), already ended, or stopping
        run.members.signal(signal.SIGTERM)
        run.stopper = asyncio.create_task(self._finish_stop(run))

    async def _finish_stop(self, run: _Run) -> None:
        loop = asyncio.get_running_loop()
        while run.process.returncode is None or run.members.alive():
            if loop.time() >= run.stop_deadline:
                log.warning("allocation %d: still running after its grace, SIGKILL",
                            run.req.allocation_id)
                run.members.signal(signal.SIGKILL)
                break
            await asyncio.sleep(POLL)
        await run.members.gone()  # KILL_WAIT at most
        if run.members.alive():
            # Stuck in the kernel (the driver, a hung file system): the run ends all the same,
            # its GPUs reported sick while the process lingers (_execute).
            log.error("allocation %d: the job's processes (group %s) outlived SIGKILL by %g s",
                      run.req.allocation_id, run.pid, run_processes.KILL_WAIT)
        else:
            await run.process.wait()  # gone: reaped at once

    async def _exit_status(self, run: _Run) -> int:
        """The main process's exit status, or -SIGKILL once a stop has given up on it (it
        outlived SIGKILL): an attempt must end even when its process cannot."""
        exited = asyncio.ensure_future(run.process.wait())
        try:
            while True:
                await asyncio.wait([exited] if run.stopper is None else [exited, run.stopper],
                                   timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if exited.done():
                    return exited.result()
                if run.stopper is not None and run.stopper.done():
                    return -signal.SIGKILL
        finally:
            exited.cancel()

    def _write_pid_file(self, run: _Run) -> None:
        # Lets the next agent stop this process group if this agent dies without doing so.
        try:
            self.pid_dir.mkdir(parents=True, exist_ok=True)
            (self.pid_dir / f"{run.req.allocation_id}.json").write_text(json.dumps({
                "pid": run.pid, "allocation_id": run.req.allocation_id, "job_id": run.req.job_id,
                "report_dir": str(self._report_dir(run.req)), "start_ticks": start_ticks(run.pid), "boot_id": boot_id(),
                "token": run.token, "gpus": [g.index for g in run.req.gpus]}))
        except OSError as err:
            log.warning("cannot write pid file: %s", err)


def _server_gave_up(alloc: int, what: str) -> ApplicationError:
    """How a watch the server gave up on ends. Nobody receives it, and it is no fault: benign, so
    Temporal's worker logs it without a traceback (an uncaught cancellation it logs as a failure
    with one, for every attempt a frozen machine or an outage cut off)."""
    return ApplicationError(f"allocation {alloc}: the server gave up on this watch; {what}", type=SERVER_GAVE_UP,
                            category=ApplicationErrorCategory.BENIGN)


def _ended_by_sigterm(result: RunJobResult) -> bool:
    """Ended by a SIGTERM the agent did not send: by the signal, or with 128 + 15 (a shell's, or
    jobkit's EXIT_STOPPED after its checkpoint)."""
    return not result.stopped and (result.signal == SIGTERM or result.exit_code == EXIT_STOPPED)


def _forgotten(details: activity.ActivityCancellationDetails | None) -> bool:
    """The server stopped tracking this attempt, but nobody asked for the job to stop."""
    if details is None or details.cancel_requested or details.worker_shutdown or details.reset:
        return False
    return details.timed_out or details.not_found


WORKING_DIR_WAIT = 30.0  # seconds a job's working directory may take to answer before its machine is blamed


def _working_dir_unusable(machine_id: str, why: str) -> str:
    return (f"its working directory cannot be used on machine {machine_id} ({why}); give `gpusched submit "
            "--workdir` a directory its machines have, or `--workdir none` for the agent's own")


# What exec says when the command itself is at fault (not found, not executable, not a file);
# any other error (no file descriptors, no memory), and any error before it (no space for the
# log), is the machine's.
_COMMAND_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ENOTDIR,
                   errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.E2BIG}


class _CannotExec(Exception):
    """exec refused the command itself; ``error`` says why."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _unusable_resume(report_dir: Path, resume_seq: int | None) -> str | None:
    """Why the job found its resume checkpoint unusable (jobkit's ``unusable.json``), or None.
    Only the checkpoint it was given counts: a report of another is no word on this one."""
    if resume_seq is None:
        return None
    try:
        report = json.loads((report_dir / UNUSABLE_REPORT).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("unreadable report %s: %s", report_dir / UNUSABLE_REPORT, err)
        return None
    if not isinstance(report, dict) or report.get("seq") != resume_seq:
        return None
    return str(report.get("reason") or "unusable")[:MAX_UNUSABLE_REASON]


def _write_ack(ack_file: Path, answer: dict) -> None:
    """Answer a report. One that cannot be written (a full disk) stays unanswered: the report is
    forwarded again later, and the control plane answers it the same."""
    tmp = ack_file.with_suffix(".tmp")  # written whole, then renamed: the job never reads half
    try:
        tmp.write_text(json.dumps(answer))
        tmp.replace(ack_file)
    except OSError as err:
        log.warning("cannot write %s: %s", ack_file, err)


def _unanswered(report_dir: Path) -> list[tuple[Path, Path]]:
    """(report, where its answer goes) for each checkpoint report in ``report_dir`` not answered yet."""
    if not report_dir.is_dir():
        return []
    pairs = ((f, f.with_name(f.name[:-len(".json")] + ".ack.json"))
             for f in sorted(report_dir.glob("checkpoint-*.json")) if not f.name.endswith(".ack.json"))
    return [(report, ack) for report, ack in pairs if not ack.exists()]


def _cut_log(path: Path, limit: int) -> int | None:
    """Cut a log over ``limit`` bytes back to its last ``min(LOG_KEEP, limit / 2)`` bytes, after
    a line saying so (copy-truncate: the job's descriptor appends, so its next write lands at the
    new end; what it writes between the read and the cut is lost). The bytes dropped, or None."""
    size = path.stat().st_size
    if size <= limit:
        return None
    keep = min(LOG_KEEP, limit // 2)
    with open(path, "r+b") as f:
        f.seek(size - keep)
        tail = f.read(keep)
        f.truncate(0)
    newline = tail.find(b"\n")
    tail = tail[newline + 1:] if newline >= 0 else tail  # from a whole line on
    with open(path, "ab") as f:  # appending too: never over what the job wrote since the cut
        f.write(f"# gpusched {_now()} this log passed {limit} bytes: its first {size - len(tail)} "
                f"were dropped, the rest follows\n".encode() + tail)
    return size - len(tail)


def _tail(path: Path, offset: int, lines: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            start = max(offset, end - _TAIL_BYTES)
            f.seek(start)
            # No NUL: the lines become the job's end reason, which Postgres text cannot hold.
            text = f.read().decode(errors="replace").replace("\0", "\ufffd")
    except OSError:
        return []
    out = text.splitlines()
    if start > offset and out:
        out = out[1:]  # began mid-line
    return [line[-_LINE_CHARS:] for line in out[-lines:]]


def _append(path: Path, text: str) -> None:
    """Add the agent's own line to a log. A line that cannot be written (a full disk) is lost, not
    the run's result: a job that succeeded must not be taken for the machine's failure, and run again."""
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as err:
        log.warning("cannot write to %s: %s", path, err)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
