"""The discrete-event simulator: trace jobs arrive, a policy's cycle decides, the engine obeys.

It keeps the live system's semantics so that what it measures is what production would see:
  - every decision comes from a cycle function called with a snapshot, exactly as the live
    scheduler workflow calls it; the engine only carries decisions out;
  - a preempted job gets its grace period: it writes a checkpoint (taking `checkpoint_write_s`),
    releases its GPUs, and resumes later from that checkpoint; a job that never checkpoints, or
    cannot finish its checkpoint within the grace, loses the work since its last checkpoint;
  - a job on a failed machine loses the work since its last interval checkpoint and is
    requeued; a job on a failed GPU checkpoints and moves (it is still alive);
  - interval checkpoints fall at the times the cycle's checkpoint phase says;
  - with `restart_s`, every attempt after a job's first spends that long starting again (a new
    process, its checkpoint loaded) before it makes progress: the price of each preemption,
    move or failure beyond the work it loses, reported as restart overhead. With `learn_restart`
    the scheduler expects restarts to take that long once the first restarted attempt has its
    state back, as the live loop learns it from the restarts jobs report.
A cycle runs whenever something happened (coalesced per timestamp) and when the last cycle
asked to be woken. Its wall time is measured with a stopwatch the caller hands in (the CLI
passes time.perf_counter); nothing under scheduler/ reads a clock itself.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from scheduler import quotas as quota_rules
from scheduler.capacity import Capacity
from scheduler.cycle import run_cycle
from scheduler.errors import InputError
from scheduler.fleet import Fleet
from scheduler.forecast import SubmissionLog
from scheduler.gc_policy import few_collections
from scheduler.models import (
    CycleResult,
    Machine,
    PolicyConfig,
    QueuedJob,
    RunningJob,
    Snapshot,
    gpu_path,
)
from scheduler.never_fits import why_it_never_fits
from scheduler.placement import find_gpus
from scheduler.sim.baselines import easy_cycle, fifo_cycle
from scheduler.sim.records import AllocationRecord, CheckpointWrite, JobRecord, Sample, SimResult
from scheduler.sim.trace import TraceJob

POLICIES: dict[str, Callable[[Snapshot], CycleResult]] = {
    "gpusched": run_cycle,
    "fifo": fifo_cycle,
    "easy": easy_cycle,
}
ESTIMATING = frozenset({"gpusched"})  # the policies that tell a waiting job when it should start


class SimSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyConfig = PolicyConfig()
    checkpoint_write_s: float = Field(default=30.0, ge=0)  # time to write one checkpoint
    checkpoint_bytes_per_gpu: float = Field(default=25e9, ge=0)  # 8 GPUs: 200 GB (docs/simulator.md)
    sigterm_exit_s: float = Field(default=5.0, ge=0)  # a job that cannot checkpoint just exits
    # An attempt after the first starts again before it progresses; a day at most (longer is no
    # restart, and a simulation of one ran for ever).
    restart_s: float = Field(default=0.0, ge=0, le=86400)
    learn_restart: bool = False  # policy.expected_restart_s becomes restart_s once a restart has been seen
    # Per machine, per GPU. At most 100 a day: with the 30-minute repair, 48 a day keep a machine
    # down 63% of the time (failures overlap), and rates far beyond had the simulation run for ever.
    machine_failures_per_day: float = Field(default=0.0, ge=0, le=100)
    gpu_failures_per_day: float = Field(default=0.0, ge=0, le=100)
    repair_s: float = Field(default=1800.0, gt=0)
    seed: int = 0
    until: float | None = Field(default=None, ge=0)  # stop here even if jobs remain


def check_failure_rates(trace: list[TraceJob], fleet: Fleet, settings: SimSettings) -> None:
    """InputError where the failures to inject would be more than a run takes: each is an event
    drawn at the run's start, and a trace of a decade, at any rate, took all the host's memory (a
    MemoryError, or the run killed). Asked before anything is written."""
    if not trace:
        return
    span = _failure_span(trace, settings)
    machines = [m for c in fleet.clusters for m in c.machines]
    for per_day, flag, units, what in (
            (settings.machine_failures_per_day, "--machine-failures-per-day", len(machines), "machines"),
            (settings.gpu_failures_per_day, "--gpu-failures-per-day", sum(m.gpus for m in machines), "GPUs")):
        expected = per_day * units / 86400.0 * span
        if expected > MAX_FAILURES:
            raise InputError(
                "simulate", None, flag,
                f"{per_day:g} a day on {units:,} {what} over the {span / 86400:,.1f} days the trace spans makes about "
                f"{expected:,.0f} failures, more than the {MAX_FAILURES:,} a run takes; give a lower rate, or a "
                "shorter span (--until)")


def _failure_span(trace: list[TraceJob], settings: SimSettings) -> float:
    """How long failures are injected for: from the first submit to the last job's end, or to
    ``until`` (nothing after it is simulated)."""
    start = min(j.submit_time for j in trace)
    span = max(j.submit_time + j.duration for j in trace) - start
    return span if settings.until is None else max(0.0, min(span, settings.until - start))


MAX_CYCLES_PER_INSTANT = 4
MAX_FAILURES = 1_000_000  # per kind, over a run: each is an event, and all are drawn at its start

# Event kinds, in the order they apply within one timestamp.
RELEASE, FINISH, MACHINE_DOWN, MACHINE_UP, GPU_DOWN, GPU_UP, SUBMIT, WAKE = range(8)


@dataclass
class JobLife:
    trace: TraceJob
    cluster: str
    progress: float = 0.0  # work saved by the last complete checkpoint
    queued_since: float = 0.0
    state: str = "pending"  # pending | queued | running | draining | completed | rejected
    reason: str = ""
    attempt: int = 0
    running: RunningJob | None = None
    next_checkpoint: float = math.inf
    first_start: float | None = None
    finish: float | None = None
    preemptions: list[float] = field(default_factory=list)  # when each was ordered (the report's count)
    requeued_preempted: list[float] = field(default_factory=list)  # when each preempted attempt ended
    lost_work: float = 0.0
    predicted_start: float | None = None
    predicted: bool = False
    under_guarantee: bool = False  # its team held less than its guarantee minus this job at submit
    reclaiming: bool = False  # ... counting the team's queued jobs ahead of it too
    release_reason: str = ""
    lost_pending: float = 0.0  # work a draining job loses when it releases
    progressing_from: float = 0.0  # when this attempt's restart ends and its work goes on
    stopped_at: float = 0.0  # when a draining job was told to stop: it makes no progress after
    released_at: float | None = None  # when a draining job really gives its GPUs back

    @property
    def spec(self):
        return self.trace.spec


class ClusterState:
    def __init__(self, name: str, machines: tuple[Machine, ...]):
        self.name = name
        self.machines = {m.id: m for m in machines}
        self.machine_tuple = machines
        self.queue: dict[str, QueuedJob] = {}
        self.running: dict[str, RunningJob] = {}
        self.busy_gpus = 0  # held by its running and draining jobs, kept in step with `running`
        self.queued_gpus = 0  # asked for by its queue, kept in step with `queue`
        self.checkpoints_due: list[tuple[float, str, int]] = []  # heap: (time, job, attempt)
        self.arrived: list[str] = []  # jobs that arrived since the last cycle: estimate their starts
        self.submissions = SubmissionLog()  # what the estimates' forecast of arrivals is made from
        self.wake: float | None = None
        self.earmarks: tuple = ()
        self.never_fits: dict[tuple, str | None] = {}
        self.empty = Capacity(machines)
        # Failed GPUs (or GPUs of a machine gone) that a job still holds while it drains: in
        # service until it leaves them, so that busy never exceeds what is counted as usable.
        self.failed_held: set[tuple[str, int]] = set()

        self.healthy_gpus = self.count_healthy()

    def replace_machine(self, machine: Machine) -> None:
        self.machines[machine.id] = machine
        self.machine_tuple = tuple(self.machines.values())
        self.healthy_gpus = self.count_healthy()

    def count_healthy(self) -> int:
        return sum(m.gpus - len(m.unhealthy_gpus) for m in self.machine_tuple if m.reachable)

    def in_service(self, machine_id: str, gpu: int) -> bool:
        m = self.machines.get(machine_id)
        return m is not None and m.reachable and gpu not in m.unhealthy_gpus

    def recount_failed_held(self, machine_id: str) -> None:
        """After a failure or repair of that machine: which of its GPUs jobs hold out of service."""
        self.failed_held = {slot for slot in self.failed_held if slot[0] != machine_id}
        for job in self.running.values():
            for slot in job.gpus:
                if slot[0] == machine_id and not self.in_service(*slot):
                    self.failed_held.add(slot)


class Simulation:
    def __init__(self, trace: list[TraceJob], fleet: Fleet, policy: str, settings: SimSettings,
                 stopwatch: Callable[[], float] | None = None):
        # The core never reads a clock; the caller may hand in one to time each cycle call.
        if policy not in POLICIES:
            raise ValueError(f"unknown policy '{policy}'; choose one of {', '.join(POLICIES)}")
        self.stopwatch = stopwatch
        self.policy_name = policy
        self.cycle = POLICIES[policy]
        self.settings = settings
        self.policy = settings.policy  # what the scheduler is told; it may learn restart times
        # Restarting attempts (by job) and when each has its state back: the scheduler learns the
        # restart time from the first that gets there, not from one stopped before (preempted
        # while it restarted: the live loop hears no restart time from it).
        self.restarting: dict[str, float] = {}
        self.restart_seen_at: float | None = None  # when the first restarted attempt had its state back
        self.fleet = fleet
        self.quotas = fleet.every_quota
        self.clusters = {c.name: ClusterState(c.name, c.machines) for c in fleet.clusters}
        self.jobs: dict[str, JobLife] = {}
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.allocations: list[AllocationRecord] = []
        self.checkpoints: list[CheckpointWrite] = []
        self.samples: list[Sample] = []
        self.cycle_ms: list[float] = []
        self.reclaim_latencies: list[float] = []
        self.freed_now: set[str] = set()  # clusters whose GPUs a decision freed this instant
        # Failures not yet repaired, per machine and per GPU: failures overlap, and a unit comes
        # back only when the last of them is repaired.
        self.failures_open: dict[tuple, int] = {}
        for job in trace:
            self.jobs[job.spec.job_id] = JobLife(trace=job, cluster="")
            self.push(job.submit_time, SUBMIT, job.spec.job_id)
        self.start = min((j.submit_time for j in trace), default=0.0)
        self._inject_failures(trace)

    # --- event plumbing ----------------------------------------------------------------------

    def push(self, at: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (at, kind, self.seq, payload))
        self.seq += 1

    def run(self) -> SimResult:
        with few_collections(freeze=True):  # the trace and fleet are loaded: set them aside
            return self._run()

    def _run(self) -> SimResult:
        until = self.settings.until
        now = self.start
        while self.events:
            now = self.events[0][0]
            if until is not None and now > until:
                now = until
                break
            touched: set[str] = set()
            while self.events and self.events[0][0] == now:
                _, kind, _, payload = heapq.heappop(self.events)
                touched |= self.apply_event(now, kind, payload)
            # A cycle's decisions can free GPUs at once (a killed job, an instant checkpoint): the
            # cluster then gets another cycle at the same moment, as the live loop's wake would.
            cycled = bool(touched)
            for _ in range(MAX_CYCLES_PER_INSTANT):
                if not touched:
                    break
                for name in sorted(touched):
                    self.run_cycle(self.clusters[name], now)
                touched, self.freed_now = self.freed_now, set()
            if cycled:
                self.sample(now)
        return self.result(now)

    def apply_event(self, now: float, kind: int, payload) -> set[str]:
        if kind == SUBMIT:
            return self.submit(now, payload)
        if kind == FINISH:
            job_id, attempt = payload
            life = self.jobs[job_id]
            if life.attempt != attempt or life.state != "running":
                return set()
            self.close_allocation(life, now, "completed", lost=0.0)
            life.state, life.finish = "completed", now
            return {life.cluster}
        if kind == RELEASE:
            job_id, attempt = payload
            life = self.jobs[job_id]
            if life.attempt != attempt or life.state != "draining":
                return set()
            return self.requeue(life, now)
        if kind == WAKE:
            cluster = self.clusters[payload]
            return {payload} if cluster.wake == now else set()
        if kind in (MACHINE_DOWN, MACHINE_UP, GPU_DOWN, GPU_UP):
            return self.fault(now, kind, payload)
        raise ValueError(kind)

    # --- jobs --------------------------------------------------------------------------------

    def submit(self, now: float, job_id: str) -> set[str]:
        life = self.jobs[job_id]
        spec = life.spec
        cluster = self.route(life)
        life.cluster = cluster.name
        # One pass over the team's queued jobs: how many (for the queue cap), and the GPUs of
        # those of this class or a more important one (ahead of it, for the reclaim count).
        # The queue cap counts the team's waiting jobs in every cluster, as live admission does.
        queued = ahead = 0
        for other in self.clusters.values():
            for q in other.queue.values():
                if q.spec.team == spec.team:
                    queued += 1
                    if other is cluster and q.spec.priority.rank <= spec.priority.rank:
                        ahead += q.spec.num_gpus
        refusal = quota_rules.admission_refusal(spec.team, queued, self.quotas, spec.num_gpus)
        if refusal is None:
            refusal = self.never_fits(cluster, life)
        if refusal is not None:
            life.state, life.reason = "rejected", refusal
            return set()
        held = sum(r.spec.num_gpus for r in cluster.running.values() if r.spec.team == spec.team)
        quota = quota_rules.quota_of(self.quotas, spec.team)
        life.under_guarantee = quota is not None and held + spec.num_gpus <= quota.guaranteed
        # A reclaim: the team's guarantee covers this job beyond what the team holds and what it
        # already waits for ahead of it. A job behind its own team's backlog beyond the guarantee
        # is borrowing demand instead.
        life.reclaiming = life.under_guarantee and held + ahead + spec.num_gpus <= quota.guaranteed
        life.state, life.queued_since = "queued", now
        cluster.queue[job_id] = QueuedJob(spec=spec, submit_time=now, queued_since=now)
        cluster.queued_gpus += spec.num_gpus
        cluster.arrived.append(job_id)
        cluster.submissions.add(now, spec.priority, spec.num_gpus, spec.expected_duration)
        return {cluster.name}

    def route(self, life: JobLife) -> ClusterState:
        if life.spec.cluster is not None and life.spec.cluster in self.clusters:
            return self.clusters[life.spec.cluster]
        if len(self.clusters) == 1:
            return next(iter(self.clusters.values()))

        def load(c: ClusterState) -> float:
            demand = sum(q.spec.num_gpus for q in c.queue.values())
            demand += sum(r.spec.num_gpus for r in c.running.values())
            return demand / max(1, c.healthy_gpus)

        fitting = [c for c in self.clusters.values() if self.never_fits(c, life) is None]
        return min(fitting or self.clusters.values(), key=lambda c: (load(c), c.name))

    def never_fits(self, cluster: ClusterState, life: JobLife) -> str | None:
        """A job that could not start even on the empty cluster is refused at submit."""
        spec = life.spec
        shape = (spec.num_gpus, spec.topology, spec.gpu_type, spec.gpu_memory_gb, spec.kind)
        if shape not in cluster.never_fits:
            ok = find_gpus(cluster.empty, spec) is not None
            why = None if ok else why_it_never_fits(spec, cluster.machines.values())
            cluster.never_fits[shape] = None if ok else (
                f"can never start on cluster {cluster.name}: "
                + (f"{why[1]} (field {why[0]})" if why else
                   f"{spec.num_gpus} GPUs with topology {spec.topology.value if spec.topology else 'default'} "
                   "do not fit its machines")
            )
        return cluster.never_fits[shape]

    def place(self, cluster: ClusterState, now: float, job_id: str, gpus, phase) -> None:
        life = self.jobs[job_id]
        queued = cluster.queue.pop(job_id)
        cluster.queued_gpus -= queued.spec.num_gpus
        life.attempt += 1
        life.state = "running"
        life.progressing_from = now + (self.settings.restart_s if life.attempt > 1 else 0.0)
        if life.attempt > 1 and self.restart_seen_at is None and self.settings.learn_restart and self.settings.restart_s:
            self.restarting[job_id] = life.progressing_from
        if life.first_start is None:
            life.first_start = now
            if life.reclaiming and now > life.trace.submit_time:
                self.reclaim_latencies.append(now - life.trace.submit_time)
        interval = life.spec.checkpoint_interval
        life.running = RunningJob(
            spec=life.spec, submit_time=queued.submit_time, gpus=gpus, started_at=now,
            progress_at_start=life.progress, preemptions=tuple(life.requeued_preempted), checkpoint_phase=phase,
        )
        life.next_checkpoint = self.first_checkpoint(now, interval, phase) if interval else math.inf
        if interval:
            heapq.heappush(cluster.checkpoints_due, (life.next_checkpoint, job_id, life.attempt))
        cluster.running[job_id] = life.running
        cluster.busy_gpus += life.spec.num_gpus
        self.push(life.progressing_from + life.trace.duration - life.progress, FINISH, (job_id, life.attempt))

    @staticmethod
    def first_checkpoint(start: float, interval: float, phase: float | None) -> float:
        """An attempt's first interval checkpoint, as jobkit takes it (`Checkpointer.next_due`):
        the first time of its grid at least half an interval after the start, so that an attempt
        started just before a grid time does not save at once."""
        anchor = start if phase is None else phase
        return anchor + math.ceil((start + interval / 2 - anchor) / interval) * interval

    @staticmethod
    def checkpoint_after(t: float, start: float, interval: float, phase: float | None) -> float:
        """The first interval checkpoint strictly after t of an attempt started at `start`."""
        anchor = start if phase is None else phase
        k = math.floor((t - anchor) / interval) + 1
        return anchor + k * interval

    def saved_progress(self, life: JobLife, now: float) -> tuple[float, float | None]:
        """Work saved by the attempt's last interval checkpoint at or before now, and its time."""
        run = life.running
        interval = life.spec.checkpoint_interval
        if not interval:
            return 0.0, None
        last = self.checkpoint_after(now, run.started_at, interval, run.checkpoint_phase) - interval
        if (last < self.first_checkpoint(run.started_at, interval, run.checkpoint_phase)
                or last < life.progressing_from):  # none before the first, nor while it restarts
            return run.progress_at_start, None
        return self.done_by(life, last), last

    @staticmethod
    def done_by(life: JobLife, t: float) -> float:
        """The job's progress at t in its current attempt: nothing is done while it restarts."""
        return life.running.progress_at_start + max(0.0, t - life.progressing_from)

    def stop(self, cluster: ClusterState, life: JobLife, now: float, reason: str, graceful: bool,
             for_job: str | None = None) -> None:
        """Preempt (graceful) or kill (not graceful) a running job; account what it loses."""
        run = life.running
        if self.restarting.get(life.spec.job_id, -math.inf) > now:
            del self.restarting[life.spec.job_id]  # stopped before it had its state back
        # A draining job stopped working when it was told to; a failure now cuts its grace short.
        done = self.done_by(life, life.stopped_at if life.state == "draining" else now)
        can_save = life.spec.checkpoints and self.settings.checkpoint_write_s <= self.settings.policy.grace_period
        if graceful and now < life.progressing_from:
            # Stopped while it restarts: its state is not back, so it has nothing new to write,
            # and it exits as a job does on SIGTERM, keeping the checkpoint it resumed from.
            saved, release = done, now + min(self.settings.sigterm_exit_s, self.settings.policy.grace_period)
        elif graceful and can_save:
            saved, release = done, now + self.settings.checkpoint_write_s
            self.checkpoints.append(CheckpointWrite(time=now, job_id=life.spec.job_id,
                                                    bytes=self.ckpt_bytes(life)))
        elif graceful and not life.spec.checkpoints:
            saved, release = 0.0, now + min(self.settings.sigterm_exit_s, self.settings.policy.grace_period)
        elif graceful:
            saved, _ = self.saved_progress(life, now - self.settings.checkpoint_write_s)
            release = now + self.settings.policy.grace_period
        else:
            # Only a checkpoint whose write has finished can be resumed from.
            saved, _ = self.saved_progress(life, now - self.settings.checkpoint_write_s)
            release = now
        lost = max(0.0, done - saved) * life.spec.num_gpus
        life.progress = saved
        life.release_reason = reason
        if reason == "preempted":
            life.preemptions.append(now)
        if release <= now:
            self.close_allocation(life, now, reason, lost)
            self.enqueue(cluster, life, now)
            self.freed_now.add(cluster.name)
            return
        life.lost_pending = lost
        life.state, life.stopped_at, life.released_at = "draining", now, release
        # The core is told what the live store tells it: the grace period's end, not when the
        # job will really be done (which nobody knows until it exits).
        grace_end = now + self.settings.policy.grace_period
        life.running = run.model_copy(update={"draining_until": grace_end, "preempted_for": for_job})
        cluster.running[life.spec.job_id] = life.running
        self.push(release, RELEASE, (life.spec.job_id, life.attempt))

    def requeue(self, life: JobLife, now: float) -> set[str]:
        cluster = self.clusters[life.cluster]
        self.close_allocation(life, now, life.release_reason, life.lost_pending)
        self.enqueue(cluster, life, now)
        return {cluster.name}

    def enqueue(self, cluster: ClusterState, life: JobLife, now: float) -> None:
        if life.release_reason == "preempted":
            # What the core's thrash protection counts, as the live store records it (REQUEUE_JOB):
            # the time the preempted attempt ended, and none for one a failure cut short.
            life.requeued_preempted.append(now)
        life.release_reason, life.released_at = "", None
        life.state, life.queued_since, life.running = "queued", now, None
        life.next_checkpoint = math.inf
        cluster.queue[life.spec.job_id] = QueuedJob(
            spec=life.spec, submit_time=life.trace.submit_time, queued_since=now,
            progress=life.progress, preemptions=tuple(life.requeued_preempted),
        )
        cluster.queued_gpus += life.spec.num_gpus

    def close_allocation(self, life: JobLife, now: float, reason: str, lost: float) -> None:
        run = life.running
        cluster = self.clusters[life.cluster]
        if cluster.running.pop(life.spec.job_id, None) is not None:
            cluster.busy_gpus -= life.spec.num_gpus
            cluster.failed_held.difference_update(run.gpus)
        life.lost_work += lost
        interval = life.spec.checkpoint_interval
        if interval:
            t = self.first_checkpoint(run.started_at, interval, run.checkpoint_phase)
            released = life.released_at  # None but while it drains
            stop = min(now, released or now)
            if released is not None:
                stop = min(stop, max(run.started_at, released - self.settings.checkpoint_write_s))
            while t < stop:
                if t >= life.progressing_from:  # none while it restarts: its state is not back yet
                    self.checkpoints.append(CheckpointWrite(time=t, job_id=life.spec.job_id,
                                                            bytes=self.ckpt_bytes(life)))
                t += interval
        self.allocations.append(AllocationRecord(
            job_id=life.spec.job_id, start=run.started_at, end=now, reason=reason,
            gpus=tuple(gpu_path(s) for s in run.gpus), lost_work=lost,
            restart_work=max(0.0, min(now, life.progressing_from) - run.started_at) * life.spec.num_gpus,
            checkpoint_interval=interval or None, checkpoint_phase=run.checkpoint_phase,
        ))

    def ckpt_bytes(self, life: JobLife) -> float:
        return life.spec.num_gpus * self.settings.checkpoint_bytes_per_gpu

    # --- faults ------------------------------------------------------------------------------

    def _inject_failures(self, trace: list[TraceJob]) -> None:
        s = self.settings
        if not trace or (s.machine_failures_per_day == 0 and s.gpu_failures_per_day == 0):
            return
        check_failure_rates(trace, self.fleet, s)
        rng = random.Random(s.seed)
        span = _failure_span(trace, s)
        machines = [(c.name, m) for c in self.fleet.clusters for m in c.machines]
        most = max((m.gpus for _, m in machines), default=0)
        for per_day, kind in ((s.machine_failures_per_day, MACHINE_DOWN), (s.gpu_failures_per_day, GPU_DOWN)):
            units = len(machines) if kind == MACHINE_DOWN else sum(m.gpus for _, m in machines)
            rate = per_day * units / 86400.0
            t = self.start
            while rate > 0:
                t += rng.expovariate(rate)
                if t > self.start + span:
                    break
                cluster, machine = machines[rng.randrange(len(machines))]
                if kind == GPU_DOWN:
                    # Every GPU fails at the same rate: a machine is hit in proportion to its GPUs
                    # (drawn again with probability 1 - gpus / most; never on a uniform fleet,
                    # whose draws stay as they were).
                    while machine.gpus < most and rng.random() * most >= machine.gpus:
                        cluster, machine = machines[rng.randrange(len(machines))]
                gpu = rng.randrange(machine.gpus)
                self.push(t, kind, (cluster, machine.id, gpu))
                self.push(t + s.repair_s, MACHINE_UP if kind == MACHINE_DOWN else GPU_UP, (cluster, machine.id, gpu))

    def fault(self, now: float, kind: int, payload) -> set[str]:
        name, machine_id, gpu = payload
        cluster = self.clusters[name]
        m = cluster.machines[machine_id]
        unit = (name, machine_id) if kind in (MACHINE_DOWN, MACHINE_UP) else (name, machine_id, gpu)
        open_now = self.failures_open.get(unit, 0) + (1 if kind in (MACHINE_DOWN, GPU_DOWN) else -1)
        self.failures_open[unit] = open_now
        if kind in (MACHINE_UP, GPU_UP) and open_now > 0:
            return set()  # another failure of it is still being repaired
        if kind == MACHINE_DOWN:
            m = m.model_copy(update={"reachable": False})
        elif kind == MACHINE_UP:
            m = m.model_copy(update={"reachable": True})
        elif kind == GPU_DOWN:
            m = m.model_copy(update={"unhealthy_gpus": m.unhealthy_gpus | {gpu}})
        else:
            m = m.model_copy(update={"unhealthy_gpus": m.unhealthy_gpus - {gpu}})
        cluster.replace_machine(m)
        cluster.recount_failed_held(machine_id)
        return {name}

    # --- the cycle ---------------------------------------------------------------------------

    def snapshot(self, cluster: ClusterState, now: float) -> Snapshot:
        self.refresh_checkpoints(cluster, now)
        arrived, cluster.arrived = cluster.arrived, []
        if self.restart_seen_at is None and self.restarting:
            back = [t for t in self.restarting.values() if t <= now]
            if back:
                self.restart_seen_at, self.restarting = min(back), {}
        if self.restart_seen_at is not None and now >= self.restart_seen_at and self.policy is self.settings.policy:
            self.policy = self.settings.policy.model_copy(update={"expected_restart_s": self.settings.restart_s})
        return Snapshot.model_construct(
            cluster=cluster.name, now=now, machines=cluster.machine_tuple,
            running=tuple(cluster.running.values()), queue=tuple(cluster.queue.values()),
            quotas=self.quotas, config=self.policy, earmarks=cluster.earmarks, estimate=bool(arrived),
            estimate_only=frozenset(arrived),
            expected_arrivals=cluster.submissions.expected_arrivals(now, self.policy) if arrived else (),
        )

    def refresh_checkpoints(self, cluster: ClusterState, now: float) -> None:
        """Tell the snapshot about interval checkpoints completed since the last cycle."""
        due, refreshed = cluster.checkpoints_due, []
        while due and due[0][0] <= now:
            at, job_id, attempt = heapq.heappop(due)
            life = self.jobs[job_id]
            if life.attempt != attempt or life.state != "running" or life.next_checkpoint != at:
                continue  # that attempt has been stopped since: it will not checkpoint again
            run = life.running
            _, last = self.saved_progress(life, now)
            life.running = run.model_copy(update={"last_checkpoint_at": last})
            cluster.running[job_id] = life.running
            life.next_checkpoint = self.checkpoint_after(now, run.started_at, life.spec.checkpoint_interval,
                                                         run.checkpoint_phase)
            refreshed.append((life.next_checkpoint, job_id, attempt))
        # Pushed back only now: rounding can put the next checkpoint at `now` itself, and a job
        # is refreshed once a cycle, as it always was.
        for entry in refreshed:
            heapq.heappush(due, entry)

    def run_cycle(self, cluster: ClusterState, now: float) -> None:
        snapshot = self.snapshot(cluster, now)
        if self.stopwatch is None:
            result = self.cycle(snapshot)
        else:
            began = self.stopwatch()
            result = self.cycle(snapshot)
            self.cycle_ms.append((self.stopwatch() - began) * 1000.0)
        for requeue in result.requeues:
            life = self.jobs[requeue.job_id]
            if life.state in ("running", "draining"):
                if life.state == "draining" and requeue.graceful:
                    continue
                self.stop(cluster, life, now, "machine_failure", graceful=requeue.graceful)
        for preemption in result.preemptions:
            life = self.jobs[preemption.job_id]
            if life.state == "running":
                self.stop(cluster, life, now, "preempted", graceful=True, for_job=preemption.for_job)
        for placement in result.placements:
            self.place(cluster, now, placement.job_id, placement.gpus, placement.checkpoint_phase)
        # The ETA a user is shown at submit: from the first cycle that saw the job.
        for pending in result.pending:
            life = self.jobs[pending.job_id]
            if not life.predicted:
                life.predicted, life.predicted_start = True, pending.estimated_start
        for placement in result.placements:
            life = self.jobs[placement.job_id]
            if not life.predicted:
                # Started at once: "now" is its estimate, where the policy makes estimates (the
                # baselines' files left it empty only for the jobs that waited).
                life.predicted = True
                life.predicted_start = now if self.policy_name in ESTIMATING else None
        cluster.earmarks = result.earmarks
        cluster.wake = result.next_wake
        if result.next_wake is not None and result.next_wake > now:
            self.push(result.next_wake, WAKE, cluster.name)

    def sample(self, now: float) -> None:
        busy = healthy = queued_jobs = queued_gpus = 0
        for cluster in self.clusters.values():
            busy += cluster.busy_gpus
            healthy += cluster.healthy_gpus + len(cluster.failed_held)
            queued_jobs += len(cluster.queue)
            queued_gpus += cluster.queued_gpus
        self.samples.append(Sample(time=now, busy_gpus=busy, healthy_gpus=healthy,
                                   queued_jobs=queued_jobs, queued_gpus=queued_gpus))

    # --- the end -----------------------------------------------------------------------------

    def result(self, now: float) -> SimResult:
        states = {life.state for life in self.jobs.values()}
        if not states & {"running", "draining"} and (self.settings.until is None or not states & {"queued", "pending"}):
            # The run ends with its last job's event: repairs after it change nothing (an --until
            # later than that ends it no later).
            now = max([self.start] + [a.end for a in self.allocations] + [life.trace.submit_time for life in self.jobs.values()])
        end = max([now, self.start] + [a.end for a in self.allocations])
        for life in self.jobs.values():
            if life.state == "draining":  # stopped already: its allocation ends as it was stopped, work lost and all
                self.close_allocation(life, now, life.release_reason, life.lost_pending)
            elif life.state == "running":
                self.close_allocation(life, now, "cancelled", 0.0)
        jobs = []
        for life in self.jobs.values():
            spec = life.spec
            state = {"draining": "running", "pending": "queued"}.get(life.state, life.state)
            reason = life.reason
            if life.state == "pending":
                reason = "not yet submitted when the simulation ended (--until)"
            elif state == "queued" and not reason:
                reason = "still queued when the simulation ended"
            elif state == "running" and not reason:
                reason = "still running when the simulation ended (--until)"
            jobs.append(JobRecord(
                job_id=spec.job_id, team=spec.team, priority=spec.priority, num_gpus=spec.num_gpus,
                kind=spec.kind.value, submit=life.trace.submit_time, first_start=life.first_start,
                finish=life.finish, state=state, reason=reason, preemptions=len(life.preemptions),
                preemption_times=tuple(life.preemptions), lost_work=life.lost_work,
                predicted_start=life.predicted_start, duration=life.trace.duration,
                expected_duration=spec.expected_duration, under_guarantee_at_submit=life.under_guarantee,
            ))
        gpus = sum(m.gpus for c in self.fleet.clusters for m in c.machines)
        return SimResult(
            policy=self.policy_name, allocations=self.allocations, jobs=jobs, samples=self.samples,
            checkpoint_writes=sorted(self.checkpoints, key=lambda c: c.time), cycle_ms=self.cycle_ms,
            quotas=dict(self.quotas), total_gpus=gpus,
            reclaim_latencies=self.reclaim_latencies, start=self.start, end=end,
        )


def simulate(trace: list[TraceJob], fleet: Fleet, policy: str = "gpusched",
             settings: SimSettings | None = None, stopwatch: Callable[[], float] | None = None) -> SimResult:
    """Run a whole trace; `stopwatch` (e.g. time.perf_counter) times each cycle when given."""
    return Simulation(trace, fleet, policy, settings or SimSettings(), stopwatch).run()
