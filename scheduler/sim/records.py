"""What a simulation run leaves behind; the report turns it into files and metrics."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from scheduler.models import Priority, Quota


class Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class AllocationRecord(Record):
    """One time a job held GPUs (a row of allocations.csv)."""

    job_id: str
    start: float
    end: float
    reason: str  # completed | preempted | failed | cancelled | machine_failure
    gpus: tuple[str, ...]  # topology paths
    lost_work: float = 0.0  # GPU-seconds of progress thrown away when it ended
    restart_work: float = 0.0  # GPU-seconds it spent starting again before it progressed
    checkpoint_interval: float | None = None
    checkpoint_phase: float | None = None  # None: checkpoints at start + k * interval


class JobRecord(Record):
    """One job's life (a row of jobs.csv)."""

    job_id: str
    team: str
    priority: Priority
    num_gpus: int
    kind: str
    submit: float
    first_start: float | None
    finish: float | None
    state: str  # completed | queued | running | rejected
    reason: str = ""  # why it is rejected or unfinished
    preemptions: int = 0
    preemption_times: tuple[float, ...] = ()
    lost_work: float = 0.0  # GPU-seconds
    predicted_start: float | None = None  # the ETA the cycle gave at submit
    duration: float  # the work it needed (trace truth)
    expected_duration: float
    under_guarantee_at_submit: bool = False  # its team had room under its guarantee for it


class Sample(Record):
    """The cluster just after one cycle's decisions; a step function over time."""

    time: float
    busy_gpus: int  # GPUs held by jobs, draining ones included
    healthy_gpus: int  # usable GPUs, and failed ones a draining job still holds (it leaves them soon)
    queued_jobs: int
    queued_gpus: int


class CheckpointWrite(Record):
    time: float
    job_id: str
    bytes: float


class SimResult(Record):
    policy: str
    allocations: list[AllocationRecord]
    jobs: list[JobRecord]
    samples: list[Sample]
    checkpoint_writes: list[CheckpointWrite]
    cycle_ms: list[float]  # wall time of each cycle call, measured by the engine
    quotas: dict[str, Quota]
    total_gpus: int
    reclaim_latencies: list[float] = Field(default_factory=list)  # seconds, see engine
    start: float
    end: float
