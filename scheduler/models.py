"""The vocabulary of the scheduling core: what goes into a cycle and what comes out.

Every model is frozen: a cycle reads a snapshot and returns decisions, it never edits its input.
Times are plain seconds on one clock chosen by the caller (trace seconds in the simulator, epoch
seconds in the live system); the core never reads a clock itself.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

GpuSlot = tuple[str, int]
"""One GPU as (machine id, index on the machine); its topology path is ``f"{machine}/{index}"``."""


def gpu_path(slot: GpuSlot) -> str:
    return f"{slot[0]}/{slot[1]}"


MOST_GPU_MEMORY_GB = 100_000.0  # a hundred times today's largest: more is a typo, or an overflow
MIN_CHECKPOINT_INTERVAL = 1.0  # seconds; a shorter interval would checkpoint at every step
# Bounds of the policy's durations: past them a knob is a typo (a grace period of 1e308 s), and
# the arithmetic built on it overflows or plans absurd horizons.
HOUR = 3600.0
DAY = 86400.0
WEEK = 7 * DAY
YEAR = 365 * DAY


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Priority(str, Enum):
    critical = "critical"
    high = "high"
    normal = "normal"
    low = "low"

    # 0 for the most important class; queue order and victim order both sort on it. A plain
    # attribute of each member (set below) rather than a property: cycles read it millions of times.
    rank: int


for _rank, _priority in enumerate((Priority.critical, Priority.high, Priority.normal, Priority.low)):
    _priority.rank = _rank


class Topology(str, Enum):
    machine = "machine"  # all GPUs on one machine
    block = "block"  # all machines in one network block
    any = "any"


class JobKind(str, Enum):
    training = "training"
    inference = "inference"


INFERENCE_PARTITION = "inference"


class JobSpec(Frozen):
    """What a user asks for. Immutable for the life of the job, except priority bumps."""

    # A NaN deadline or time compares false both ways: the queue's order would not be total.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    job_id: str = Field(min_length=1)
    team: str = Field(min_length=1)
    num_gpus: int = Field(ge=1)
    gpu_type: str | None = None
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    topology: Topology | None = None  # None: machine if it fits one machine, else block
    priority: Priority = Priority.normal
    deadline: float | None = None  # a hint, on the snapshot's clock
    checkpoint_interval: float | None = Field(default=None, ge=0)  # None or 0: never checkpoints
    expected_duration: float = Field(gt=0)  # the user's estimate, seconds of running
    kind: JobKind = JobKind.training
    cluster: str | None = None  # None: any cluster

    @property
    def checkpoints(self) -> bool:
        return bool(self.checkpoint_interval)

    def topology_for(self, gpus_per_machine: int) -> Topology:
        if self.topology is not None:
            return self.topology
        return Topology.machine if self.num_gpus <= gpus_per_machine else Topology.block


class QueuedJob(Frozen):
    """A job waiting for GPUs: new, or requeued after a preemption or failure."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    spec: JobSpec
    submit_time: float
    queued_since: float  # when it last entered the queue
    progress: float = Field(default=0.0, ge=0)  # seconds of work saved in its last complete checkpoint
    preemptions: tuple[float, ...] = ()  # when it was preempted, oldest first

    @property
    def resumes(self) -> bool:
        """Whether its next attempt starts again from an earlier one (a checkpoint, or a preemption)."""
        return self.progress > 0 or bool(self.preemptions)

    @model_validator(mode="after")
    def _queued_after_submit(self) -> "QueuedJob":
        if self.queued_since < self.submit_time:
            raise ValueError("queued_since is before submit_time")
        return self


OVERRUN_FLOOR = 300.0
OVERRUN_SHARE = 0.2


class RunningJob(Frozen):
    """A job holding GPUs: running, or draining (told to checkpoint and stop) after a preemption."""

    spec: JobSpec
    submit_time: float
    gpus: tuple[GpuSlot, ...]
    started_at: float
    progress_at_start: float = Field(default=0.0, ge=0)  # work resumed from a checkpoint
    last_checkpoint_at: float | None = None  # last complete checkpoint of this attempt
    preemptions: tuple[float, ...] = ()
    checkpoint_phase: float | None = None  # checkpoints fall at times ≡ phase (mod interval)
    draining_until: float | None = None  # preempted: the end of its grace period
    preempted_for: str | None = None  # the job it makes room for

    @property
    def draining(self) -> bool:
        return self.draining_until is not None

    @property
    def resumed(self) -> bool:
        """Whether this attempt started again from an earlier one (a checkpoint, or a preemption)."""
        return self.progress_at_start > 0 or bool(self.preemptions)

    @property
    def estimated_end(self) -> float:
        """When it ends by the user's estimate alone, past or not (draining aside)."""
        return self.started_at + max(0.0, self.spec.expected_duration - self.progress_at_start)

    def expected_end(self, now: float) -> float:
        """When it should release its GPUs, by the user's estimate; never in the past.

        A job that has outrun its estimate is assumed to need a fifth of the estimate again
        (at least five minutes): estimates are wrong both ways, and "any moment now" is not
        an honest answer for a job that is already late."""
        if self.draining_until is not None:
            return max(now, self.draining_until)
        end = self.estimated_end
        if end <= now:
            return now + max(OVERRUN_FLOOR, OVERRUN_SHARE * self.spec.expected_duration)
        return end

    def work_at_risk(self, now: float) -> float:
        """GPU-seconds lost if it stopped now without a new checkpoint."""
        if not self.spec.checkpoints:
            since = self.started_at - self.progress_at_start  # restarts from scratch
        else:
            since = self.last_checkpoint_at if self.last_checkpoint_at is not None else self.started_at
        return max(0.0, now - since) * self.spec.num_gpus


class Machine(Frozen):
    id: str  # the topology path cluster/block/rack/machine
    cluster: str
    block: str
    rack: str
    gpus: int = Field(ge=1)
    gpu_type: str
    gpu_memory_gb: float = 80.0
    partition: str = "training"
    reachable: bool = True
    unhealthy_gpus: frozenset[int] = frozenset()
    # False while its agent owes an answer (it missed a job's heartbeat or pickup): what runs
    # there stays, but nothing new is placed there, lest a job requeued from a dead machine go
    # straight back to it before the machine's timeout has it declared unreachable.
    takes_work: bool = True
    # An operator drains it for maintenance (`gpusched fleet drain`): nothing new is placed there
    # and its jobs are asked to checkpoint and move, with their grace. A cordoned machine (`fleet
    # cordon`) only takes no work: its jobs run on, which `takes_work` says.
    drain: bool = False


QUOTA_LARGEST = 2**31 - 1  # what the store's integer columns hold; no fleet comes near it


class Quota(Frozen):
    guaranteed: int = Field(default=0, ge=0, le=QUOTA_LARGEST)
    max: int | None = Field(default=None, ge=0, le=QUOTA_LARGEST)  # None: no maximum
    queue_cap: int | None = Field(default=None, ge=0, le=QUOTA_LARGEST)  # None: no cap

    @model_validator(mode="after")
    def _max_covers_guarantee(self) -> "Quota":
        if self.max is not None and self.max < self.guaranteed:
            raise ValueError(f"max ({self.max}) is below guaranteed ({self.guaranteed})")
        return self


class PolicyConfig(Frozen):
    """The knobs of gpusched's policy, with the defaults documented in docs/policy.md."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    grace_period: float = Field(default=120.0, ge=0, le=DAY)
    min_runtime: float = Field(default=600.0, ge=0, le=WEEK)  # no preemption before this much running
    thrash_window: float = Field(default=3600.0, gt=0, le=WEEK)
    thrash_max_preemptions: int = Field(default=2, ge=1, le=100)  # this many in the window: protected
    starvation_threshold: float = Field(default=1800.0, ge=0, le=WEEK)  # then a blocked job gets a reservation
    max_reservations: int = Field(default=1, ge=0, le=100)
    reserved_pool_fraction: float = Field(default=0.005, ge=0, le=0.5)  # whole machines kept for big jobs
    stagger_checkpoints: bool = True
    # The staggering granularity: a day's plan has LONGEST_PERIOD / checkpoint_slot slots, each
    # looked at for every placement, so a slot under a second makes every cycle crawl.
    checkpoint_slot: float = Field(default=60.0, ge=1, le=DAY)
    max_unsaved_run: float = Field(default=900.0, ge=0, le=YEAR)  # a job that cannot checkpoint is protected after this
    max_preemption_searches: int = Field(default=16, ge=0, le=1000)  # per cycle; bounds the cycle's cost
    consolidation_wait: float = Field(default=300.0, ge=0, le=WEEK)  # then small jobs may move for a gang job
    max_consolidations: int = Field(default=2, ge=0, le=100)  # searches per cycle; 0 turns moves off
    eta_horizon: float = Field(default=30 * DAY, ge=3600, le=YEAR)
    # The forecast of arrivals behind estimates (scheduler/forecast.py): the submissions of the
    # last `forecast_window` seconds are expected again one window later (0 turns it off); an
    # arrival due t seconds from now counts for min(1, t / forecast_ramp) of its GPUs, since the
    # sooner it comes, the likelier it starts by preemption instead of taking the releases a
    # waiting job counts on.
    forecast_window: float = Field(default=DAY, ge=0, le=WEEK)
    forecast_ramp: float = Field(default=7200.0, ge=0, le=WEEK)
    # How long an attempt that resumes takes to start again before it progresses (a new process,
    # its checkpoint loaded): added to the expected end of a resumed job, so that the scheduler
    # neither waits for GPUs that come back later than it thinks nor plans on them too early.
    expected_restart_s: float = Field(default=0.0, ge=0, le=DAY)
    # The live system only: a job queued again after its second infrastructure failure in a row
    # (its agent died, its command exited 75) waits this long before it may be placed again,
    # doubled with each further one (0 turns it off), so that a passing outage of what its
    # attempts need does not spend the five failures that fail it within seconds.
    retry_backoff: float = Field(default=60.0, ge=0, le=HOUR)


class Earmark(Frozen):
    """GPUs promised to a job whose preemption victims are leaving them; nobody else takes them."""

    job_id: str
    gpus: tuple[GpuSlot, ...]
    expires: float  # a promise not taken up by then lapses (the job was cancelled, say)


class ExpectedArrival(Frozen):
    """Work the forecast expects to be submitted after now (scheduler/forecast.py)."""

    at: float
    priority: Priority
    num_gpus: int = Field(ge=1)
    expected_duration: float = Field(gt=0)


class Snapshot(Frozen):
    """One cluster as the scheduler sees it at ``now``: the only input of a cycle."""

    cluster: str
    now: float
    machines: tuple[Machine, ...]
    running: tuple[RunningJob, ...] = ()
    queue: tuple[QueuedJob, ...] = ()
    quotas: Mapping[str, Quota] = Field(default_factory=dict)
    earmarks: tuple[Earmark, ...] = ()  # as the previous cycle returned them
    config: PolicyConfig = PolicyConfig()
    # Whether to estimate start times this cycle (positions and reasons always come), and for
    # which jobs (None: all). The live loop asks for all every cycle; the simulator only for the
    # jobs that arrived since its last cycle, as it records the ETA a job is given at submit.
    estimate: bool = True
    estimate_only: frozenset[str] | None = None
    # More important work expected to arrive takes the releases a waiting job counts on: the
    # estimates allow for it (scheduler/forecast.py makes the forecast from past submissions).
    expected_arrivals: tuple[ExpectedArrival, ...] = ()


# --- Decisions -------------------------------------------------------------------------------


class Placement(Frozen):
    job_id: str
    gpus: tuple[GpuSlot, ...]
    reason: str
    checkpoint_phase: float | None = None
    backfilled: bool = False  # started ahead of a reservation without delaying it


class Preemption(Frozen):
    job_id: str  # the victim
    for_job: str  # the job that needs its GPUs
    reason: str
    grace_period: float
    # A move (consolidation): the victim restarts at once on these GPUs, earmarked for it.
    moved_to: tuple[GpuSlot, ...] = ()


class Requeue(Frozen):
    """A running job that must leave its GPUs because they are no longer usable."""

    job_id: str
    reason: str
    graceful: bool  # True: it can still checkpoint (a sick GPU, a machine drained); False: its machine is gone


class Reservation(Frozen):
    job_id: str
    machines: tuple[str, ...]
    expected_start: float


class Pending(Frozen):
    job_id: str
    position: int  # 1-based, in queue order
    estimated_start: float | None  # None: cannot start on this cluster as it is
    misses_deadline: bool | None  # None: no deadline hint
    reason: str


class CycleResult(Frozen):
    placements: tuple[Placement, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    requeues: tuple[Requeue, ...] = ()
    reservations: tuple[Reservation, ...] = ()
    pending: tuple[Pending, ...] = ()
    earmarks: tuple[Earmark, ...] = ()  # to hand to the next cycle
    next_wake: float | None = None  # the next time a cycle could decide differently with no event
