"""Inputs and results of the workflows and activities: one pydantic model each, so fields can be
added compatibly. Pure: imported by workflows (through the sandbox), activities, workers and the
client alike.

Task queues: the control worker listens on ``CONTROL_TASK_QUEUE`` (both workflows and the control
activities); the agent of machine M listens on ``agent_task_queue(M)`` (the node activities).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from scheduler.models import MIN_CHECKPOINT_INTERVAL, QUOTA_LARGEST, JobKind, Priority, Topology

CONTROL_TASK_QUEUE = "gpusched-control"
JOB_WORKFLOW = "JobWorkflow"
SCHEDULER_WORKFLOW = "ClusterSchedulerWorkflow"


def agent_task_queue(machine_id: str) -> str:
    return f"gpusched-agent-{machine_id}"


# The type of the failure a job workflow ends with when its job failed (refused included): its
# message is the job's reason, its details the job's outcome (JobOutcome).
JOB_FAILED = "JobFailed"


def job_workflow_id(job_id: str) -> str:
    return f"job-{job_id}"


def scheduler_workflow_id(cluster: str) -> str:
    return f"scheduler-{cluster}"


def first_error(error: ValidationError) -> tuple[str, str]:
    """The field at fault (dotted) and what is wrong with it, for a one-line refusal."""
    err = error.errors()[0]
    # A validator's own ValueError comes as "Value error, <its message>": the message is enough.
    return ".".join(str(p) for p in err["loc"]) or "request", err["msg"].removeprefix("Value error, ")


def flag_for(field: str) -> str:
    """The command-line flag of a (dotted) field: policy.expected_restart_s -> --expected-restart-s."""
    return "--" + field.rsplit(".", 1)[-1].replace("_", "-")


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WithNewFields(Model):
    """A model some fields of which are newer than workers that may still be running: those are
    left out of what it serializes to while they hold their defaults, so that an older worker,
    which refuses fields it does not know, still takes the model during a rolling upgrade."""

    NEW_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_new_defaults(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            for name in self.NEW_FIELDS:
                default = type(self).model_fields[name].get_default(call_default_factory=True)
                if name in data and data[name] == default:
                    del data[name]
        return data


class JobState(str, Enum):
    queued = "queued"
    placed = "placed"
    running = "running"
    checkpointing = "checkpointing"
    preempted = "preempted"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)

    @property
    def attribute(self) -> str:
        """As the `JobState` search attribute holds it, the way a Temporal query writes it
        (`JobState='Running'`); workflows before 2026-12-05 wrote the value itself."""
        return self.value.capitalize()


class EndReason(str, Enum):
    """Why an attempt gave its GPUs back; the simulator's allocations.csv uses the same words."""

    completed = "completed"
    failed = "failed"
    preempted = "preempted"
    cancelled = "cancelled"
    machine_failure = "machine_failure"
    not_started = "not_started"  # the agent never picked the attempt up


MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


class JobRequest(WithNewFields):
    """What a submitter gives: the input of ``JobWorkflow``. A pipeline using the Temporal SDK
    starts ``JobWorkflow`` with this model on ``CONTROL_TASK_QUEUE`` and workflow id
    ``job_workflow_id(job_id)``; the workflow validates it and checks quota and queue cap."""

    job_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    team: str = Field(min_length=1)
    num_gpus: int = Field(ge=1)
    command: list[str] = Field(min_length=1)
    gpu_type: str | None = None
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    topology: Topology | None = None
    priority: Priority = Priority.normal
    deadline: float | None = None  # epoch seconds, a hint
    checkpoint_interval: float | None = Field(default=None, ge=0)
    expected_duration: float = Field(default=3600.0, gt=0)
    kind: JobKind = JobKind.training
    cluster: str | None = None
    env: dict[str, str] = Field(default_factory=dict)  # extra environment for the command
    # Times an attempt whose command fails (exits non-zero by itself) is run again, resuming from
    # the newest complete checkpoint, before the job fails. Failures of machines, GPUs and agents
    # are not counted here: those requeue (five in a row fail the job; workflows.job).
    max_retries: int = Field(default=0, ge=0, le=100)
    # The directory the command runs in, on every machine of the gang (an absolute path; `gpusched
    # submit` gives the one it is run from, as Slurm's sbatch does). None: the agent's own.
    working_dir: str | None = None

    NEW_FIELDS: ClassVar[tuple[str, ...]] = ("max_retries", "working_dir")  # since 2026-12-01, 2026-12-07
    submit_time: float | None = None  # set by the workflow (epoch seconds) when missing

    # inf and nan are no number of seconds or GBs (and JSON cannot even carry them).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# A request travels in Temporal payloads (2 MB each: the workflow's input, its status, every
# attempt's activity input) and is stored in Postgres: bounded well below that.
MAX_COMMAND_BYTES = 128 * 1024
# One attempt's run orders (one per machine of a gang, each with the command and env) go into
# the job's history, which Temporal ends at 50 MiB: past this, the attempt is not started.
ATTEMPT_ORDERS_MAX = 32 * 1024 * 1024
# The agent's error type when it stops a job because it shuts down (activities/node.py).
AGENT_SHUTDOWN = "AgentShutdown"
# The agent's error types when the workflow watches an attempt again (``attach_job``) and there is
# nothing to watch: the agent has no such process (it restarted), or it stopped the process itself
# once the server had given up on the attempt and nobody watched it again in time.
ATTEMPT_NOT_HERE = "AttemptNotHere"
ATTEMPT_ABANDONED = "AttemptAbandoned"
# A job's exit code for "what I need is not there now" (sysexits' EX_TEMPFAIL; jobkit's
# EXIT_RETRY_LATER): queued again as an infrastructure failure, not counted as the job's own.
EXIT_RETRY_LATER = 75
# How a job ends that SIGTERM stopped: by the signal itself, or with 128 + 15 (what a shell
# reports, and jobkit's EXIT_STOPPED after its checkpoint). Such an end the agent did not ask
# for, followed by the agent's own shutdown, was the machine's stop: the agent says so
# (AgentShutdown), and the job is queued again; otherwise the command ended so of itself.
SIGTERM = 15
EXIT_STOPPED = 128 + SIGTERM
DEFAULT_QUOTA = "*"  # the quota of every team without its own (scheduler.quotas.quota_of)
LATEST_EPOCH = 4.0e9  # 2096: a time past it is a unit mistake (milliseconds), and breaks dates


MAX_TEAM_CHARS = 128


# A word read from a command line in a locale it is not written in (a Latin-1 file name under
# UTF-8) carries its bytes as lone surrogates, which no job history can hold.
_NOT_UTF8 = "holds bytes that are not UTF-8 (text in another encoding: a file's name, say); give it in UTF-8"


def _not_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def team_problem(team: str) -> str | None:
    """What is wrong with a team's name (and how to fix it), or None. ``*`` passes: it names the
    default quota, which a quota may be set for."""
    if not team.strip():
        return "is blank; give the team's name"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in team):
        return "holds a control character (a tab, a newline, NUL), which no team's name can carry"
    if len(team) > MAX_TEAM_CHARS:
        return f"is {len(team)} characters long; a team's name has at most {MAX_TEAM_CHARS}"
    return None


# Set by the agent in every attempt's environment, over anything the request says (with the
# GPUSCHED_* variables): a request that sets one would be silently overridden, so it is refused.
AGENT_SET_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})
# jobkit's own settings, which the agent never sets: how a job uploads and how long it waits for a
# store that does not answer are the job's to choose (jobkit's docstring).
JOB_SET_ENV = frozenset({"GPUSCHED_S3_RETRY_S", "GPUSCHED_S3_PART_MB", "GPUSCHED_S3_UPLOAD_THREADS"})


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def command_bytes(request: JobRequest) -> int:
    """The command's size in UTF-8, as it goes into the job's history with every attempt's orders."""
    return sum(len(word.encode()) for word in request.command)


def env_bytes(request: JobRequest) -> int:
    """The env's size in UTF-8, its names and values."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in request.env.items())


def request_problem(request: JobRequest) -> tuple[str, str] | None:
    """(field, what is wrong and how to fix it) for a request the model takes but no job can
    run as; None when there is none. Checked at admission, and by the CLI before it sends. Not
    in the model: requests accepted before a check was added must still decode on replay."""
    for field in ("team", "gpu_type", "cluster"):
        if "\0" in (getattr(request, field) or ""):
            return field, "holds a NUL character, which no name can carry"
        if _not_utf8(getattr(request, field) or ""):
            return field, _NOT_UTF8
    if (problem := team_problem(request.team)) is not None:
        return "team", problem
    if request.team == DEFAULT_QUOTA:
        return "team", "'*' names the default quota of every team without its own, not a team; give the team's name"
    if request.gpu_type is not None and not request.gpu_type.strip():
        return "gpu_type", "is blank; name a GPU type (H100, A100, ...) or leave it out for any"
    if request.cluster is not None and not request.cluster.strip():
        return "cluster", "is blank; name a cluster or leave it out for any"
    if request.num_gpus > QUOTA_LARGEST:
        return "num_gpus", f"is {request.num_gpus}; no fleet has more than {QUOTA_LARGEST} GPUs"
    wd = request.working_dir
    if wd is not None:
        if "\0" in wd:
            return "working_dir", "holds a NUL character, which no path can carry"
        if _not_utf8(wd):
            return "working_dir", _NOT_UTF8
        if len(wd) > MAX_PATH_CHARS:
            return "working_dir", f"is {len(wd)} characters; a path has at most {MAX_PATH_CHARS}"
        if not wd.startswith("/"):
            return "working_dir", f"is {wd!r}, a relative path; give an absolute one (the machine's directory the command runs in)"
    if not request.command[0].strip():
        return "command", "starts with an empty word; give the program to run first"
    if any("\0" in word for word in request.command):
        return "command", "holds a NUL character, which no program argument can carry"
    if any(_not_utf8(word) for word in request.command):
        return "command", _NOT_UTF8
    if _ASSIGNMENT.match(request.command[0]):
        # The agent runs the command without a shell: `A=1 python train.py` would fail to start.
        # On the command line it is also what `--env X=1 A=1 -- ...` leaves (one pair per --env).
        return "command", (f"starts with {request.command[0]!r}, a variable's assignment, not a program; "
                           "set each variable with its own --env (the API's env), and start with the program")
    for name, value in request.env.items():
        if not name or "=" in name or "\0" in name:
            return "env", f"has the variable name {name!r}; a name is not empty and holds no '=' or NUL"
        if _not_utf8(name):
            return "env", f"variable name {name!r}: {_NOT_UTF8}"
        if not name.isprintable() or any(c.isspace() for c in name):
            return "env", f"has the variable name {name!r}; a name holds no spaces or control characters"
        if name in AGENT_SET_ENV or name.startswith("GPUSCHED_") and name not in JOB_SET_ENV:
            return "env", (f"sets {name}, which the agent sets for each attempt (the granted GPUs, the "
                           "job's checkpoints: see docs/live.md); leave it out, or name yours otherwise")
        if "\0" in value:
            return "env", f"variable {name} holds a NUL character, which no environment value can carry"
        if _not_utf8(value):
            return "env", f"variable {name!r}: {_NOT_UTF8}"
    interval = request.checkpoint_interval
    if interval is not None and 0 < interval < MIN_CHECKPOINT_INTERVAL:
        return "checkpoint_interval", f"is {interval:g} s; give 0 (only when stopped) or at least 1 second"
    for field, when in (("deadline", request.deadline), ("submit_time", request.submit_time)):
        if when is not None and not 0 <= when <= LATEST_EPOCH:
            return field, f"is {when:g}; give epoch seconds (e.g. {1.8e9:.0f} for 2027)"
    size = command_bytes(request)
    if size > MAX_COMMAND_BYTES:
        return "command", (f"is {size} bytes; at most {MAX_COMMAND_BYTES} go into a job's history: "
                           "put long arguments in a file the command reads")
    size = env_bytes(request)
    if size > MAX_COMMAND_BYTES:
        return "env", (f"is {size} bytes; at most {MAX_COMMAND_BYTES} go into a job's history: "
                       "put long values in a file the job reads")
    return None


class GpuGrant(Model):
    index: int  # the GPU's index on its machine, what CUDA_VISIBLE_DEVICES names
    path: str  # topology path, e.g. c1/b0/r0/m0/3


class HostGrant(Model):
    """The part of a gang on one machine: one process runs there, on these GPUs."""

    machine_id: str
    gpus: list[GpuGrant]


class PlacementSignal(Model):
    """Sent by the scheduler to a job: run attempt ``attempt`` on these GPUs, one process per
    machine. Re-sent until the job acknowledges it; the job takes duplicates idempotently (by
    ``allocation_id``)."""

    allocation_id: int
    hosts: list[HostGrant]
    attempt: int
    grace_period: float = 120.0  # how long a stop waits for the job to checkpoint and exit
    checkpoint_phase: float | None = None
    reason: str = ""


class PreemptSignal(Model):
    """Stop this attempt and queue the job again: to make room for another job (``preempted``),
    or because its GPUs can no longer be used (``machine_failure``: not counted as a preemption)."""

    allocation_id: int  # only this allocation is stopped; a stale signal for an older one is ignored
    grace_period: float
    reason: str
    end_reason: EndReason = EndReason.preempted


class CarriedOver(Model):
    """What a job's workflow hands its next run when it continues as new between attempts (the
    job queued, holding no GPU): where it was admitted, its counts, and the signals not yet
    taken. Its request, with the class it has now, is the run's first argument."""

    cluster: str
    task_queue_prefix: str = ""
    state: JobState
    reason: str | None = None
    attempts: int
    infra_failures: int = 0
    failures: int = 0
    placements: list[PlacementSignal] = Field(default_factory=list)  # come, not yet taken up
    preempts: list[PreemptSignal] = Field(default_factory=list)  # for those placements
    # The placements last handled: the scheduler sends one again until it is acknowledged, and a
    # copy that arrives later is dropped by its id (one too old to be kept is refused by the store).
    seen_allocations: list[int] = Field(default_factory=list)


class PriorityBump(Model):
    priority: Priority


class RunJobInput(WithNewFields):
    """The node activity an agent runs: start the command pinned to its GPUs, heartbeat while it
    runs, stop it with SIGTERM → grace → SIGKILL if cancelled, report how it ended."""

    NEW_FIELDS: ClassVar[tuple[str, ...]] = ("working_dir",)  # since 2026-12-07

    job_id: str
    allocation_id: int
    attempt: int
    command: list[str]
    gpus: list[GpuGrant]
    env: dict[str, str] = Field(default_factory=dict)
    grace_period: float = 120.0
    checkpoint_uri: str | None = None  # where this job writes checkpoints (a prefix)
    resume_from: str | None = None  # the complete checkpoint to resume from, or None
    resume_seq: int | None = None  # its sequence number
    resume_sha256: str | None = None  # the digest committed for it: what the restored bytes must hash to
    checkpoint_interval: float | None = None  # seconds; None or 0: only when stopped
    checkpoint_phase: float | None = None  # staggering: checkpoints at epoch times ≡ phase (mod interval)
    working_dir: str | None = None  # the directory the command runs in; None: the agent's own


class StopOrder(Model):
    """Stop this attempt's process on the agent with this grace (SIGTERM, the grace, SIGKILL):
    the preemption's own, which may differ from the grace the attempt was launched with."""

    allocation_id: int
    grace_period: float = Field(ge=0)
    reason: str = ""


class AttachOrder(Model):
    """Watch an attempt already running on the agent again (``attach_job``): the workflow's
    earlier watch timed out for want of heartbeats while the agent was heard all along (Temporal
    was down or unreachable for longer than the heartbeat timeout). Never starts a process."""

    allocation_id: int


class HearingAsk(Model):
    """What the control plane has heard of a job's machines (``machines_heard``), after the job's
    watch timed out for want of heartbeats: each "heard" within ``within`` seconds (its agent
    lives), "silent" longer while it listened (gone), or "unsure" (the API or the database was
    down too, and it has not listened again for long enough to tell)."""

    machine_ids: list[str]
    within: float


HEARD, SILENT, UNSURE = "heard", "silent", "unsure"


class RunJobResult(WithNewFields):
    exit_code: int | None  # None: killed by a signal that was not ours
    signal: int | None = None
    stopped: bool = False  # we stopped it (preemption or cancel)
    log_path: str
    last_log_lines: list[str] = Field(default_factory=list)
    # A failed run: the faults its GPUs showed when it died ("GPU 3: xid:79"). Any, and the GPU,
    # not the job, is taken for the cause: the job is requeued instead of failed.
    gpu_faults: list[str] = Field(default_factory=list)
    # Why the job could not use the checkpoint it was told to resume from (jobkit's
    # unusable.json): the attempt's end takes it for incomplete, and its failure is not the job's.
    resume_unusable: str | None = None

    NEW_FIELDS: ClassVar[tuple[str, ...]] = ("gpu_faults", "resume_unusable")  # since 2026-12-01, -02


class AttemptView(Model):
    attempt: int
    allocation_id: int
    gpus: list[str]  # topology paths
    started_at: str | None  # ISO 8601
    ended_at: str | None
    end_reason: str | None
    resumed_from: int | None = None  # the checkpoint sequence it started from; None: from scratch
    restart_s: float | None = None  # a resumed attempt: seconds from its launch to its state restored
    # An attempt told to stop that has not ended yet: why, and when its grace ends.
    stopping: str | None = None
    stop_by: str | None = None


class CheckpointView(Model):
    seq: int
    complete: bool
    size: int
    created_at: str
    key: str
    progress: float | None = None
    allocation_id: int
    reason: str | None = None  # why it was refused
    deleted: bool = False  # superseded: its bytes are gone


class CheckpointReport(Model):
    """What a job reports (through its agent) after writing checkpoint ``seq``; see jobkit."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    seq: int = Field(ge=1, le=2**31 - 1)  # an integer column
    # Bounded: a job writes these (through its agent), and a refusal is kept with the key in it.
    key: str = Field(min_length=1, max_length=1024)  # the object's key in the checkpoint bucket
    size: int = Field(ge=0, le=2**63 - 1)  # a bigint column
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    md5: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{32}$")
    progress: float | None = None
    written_at: float | None = None
    uri: str | None = Field(default=None, max_length=2048)


class CheckpointAck(Model):
    committed: bool
    reason: str


class AttemptGrant(Model):
    """start_attempt's answer: whether to launch, and from which complete checkpoint."""

    launch: bool
    checkpoint_uri: str | None = None
    resume_from: str | None = None  # URI of the newest complete checkpoint
    resume_seq: int | None = None
    resume_sha256: str | None = None
    checkpoint_interval: float | None = None
    checkpoint_phase: float | None = None


class JobView(Model):
    """What ``gpusched status --json`` prints and the status query answers."""

    job_id: str
    team: str
    priority: str
    state: str
    num_gpus: int
    cluster: str | None
    command: list[str]
    submitted_at: str
    exit_code: int | None = None
    # Why it is in its state: a failure, a cancel, or why it went back to the queue; for a job
    # queued from the start, its pending reason.
    reason: str | None = None
    pending_reason: str | None = None  # a queued job: why it waits now, as of the last cycle
    position: int | None = None
    estimated_start: str | None = None
    deadline: str | None = None  # the submit's hint
    # A queued job with a deadline hint: whether its estimated start plus the work left misses
    # it, as of the last cycle.
    misses_deadline: bool | None = None
    preemptions: int = 0  # how many times it was displaced for other work
    attempts: list[AttemptView] = Field(default_factory=list)
    checkpoints: list[CheckpointView] = Field(default_factory=list)


class SchedulerInput(Model):
    cluster: str
    workflow_id_prefix: str = ""  # the control plane's prefix (see Admission.task_queue_prefix)
    cycle_seq: int = 0  # the last cycle committed by an earlier run (continue-as-new carries it)
    tick_seconds: float = 2.0
    cycles_per_run: int = 500  # continue-as-new after this many cycles (or when suggested)
    # How often to look for allocations whose job workflow has ended (terminated by hand, say):
    # nothing else would ever give their GPUs back.
    reconcile_seconds: float = 60.0
    reconciled_at: float | None = None  # epoch seconds of the last look (continue-as-new carries it)


class LoopSettings(Model):
    """A control worker's settings for its cluster's loop (its --tick, --cycles-per-run,
    --reconcile-every), sent to the loop as it starts (the `configure` signal): a loop that runs
    already takes them too, not only one the worker starts."""

    tick_seconds: float = Field(gt=0)
    cycles_per_run: int = Field(ge=1)
    reconcile_seconds: float = Field(gt=0)


class Reconcile(Model):
    cluster: str
    workflow_id_prefix: str = ""


class CycleInput(Model):
    cluster: str
    cycle_seq: int  # this cycle's number: the store refuses a cycle whose number is not the next


class PreemptOrder(Model):
    job_id: str
    signal: PreemptSignal


class PlacementOrder(Model):
    job_id: str
    signal: PlacementSignal


class CycleOutcome(Model):
    cycle_seq: int
    committed: bool  # False: a stale or repeated cycle, nothing changed
    placements: list[PlacementOrder] = Field(default_factory=list)  # new and unacknowledged ones
    preemptions: list[PreemptOrder] = Field(default_factory=list)
    next_wake_in: float | None = None  # seconds until the core could decide differently


class Admission(Model):
    """Whether a job joined a queue: the first step of every JobWorkflow."""

    accepted: bool
    job_id: str
    cluster: str | None = None
    reason: str  # why it was refused, or "accepted"
    field: str | None = None  # the request field at fault, when refused
    # The control plane's task-queue and workflow-id prefix (empty in production; tests set one
    # so that several stacks share a Temporal server).
    task_queue_prefix: str = ""


class StartAttempt(Model):
    job_id: str
    allocation_id: int


class EndAttempt(WithNewFields):
    job_id: str
    allocation_id: int | None  # None: whatever the job holds
    end_reason: EndReason
    exit_code: int | None = None
    next_state: JobState  # queued (to run again) or a terminal state
    reason: str
    machine_id: str | None = None  # the machine whose agent failed the attempt, when one did
    # The checkpoint the attempt resumed from, when its job found it unusable: no longer complete.
    unusable_checkpoint: int | None = None
    # Its infrastructure failures in a row, this one included, when it is queued again for one:
    # from the second on, the store holds it back (PolicyConfig.retry_backoff).
    failures_in_a_row: int = 0

    NEW_FIELDS: ClassVar[tuple[str, ...]] = ("machine_id", "unusable_checkpoint",  # since 2026-12-02
                                             "failures_in_a_row")  # since 2026-12-04


class UnusableReport(Model):
    """A machine's word that the checkpoint an attempt resumed from cannot be used (gone,
    corrupted): the control plane looks at the checkpoint store itself before it believes it."""

    job_id: str
    allocation_id: int
    seq: int
    machine_id: str | None  # the machine whose job said so (None: not known)
    said: str  # the job's own word on why


class AttemptStopping(Model):
    allocation_id: int
    grace_period: float
    reason: str


class JobStateChange(Model):
    job_id: str
    state: JobState


class PriorityChange(Model):
    job_id: str
    priority: Priority


class Wake(Model):
    cluster: str
    reason: str = ""


class JobOutcome(Model):
    """JobWorkflow's result (for a failed job, its failure's details; see JOB_FAILED), and what
    its ``status`` query answers."""

    job_id: str
    state: JobState
    priority: Priority | None = None
    cluster: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    attempts: int = 0
    allocation_id: int | None = None  # the attempt running now


class Abandoned(Model):
    """An allocation whose job's workflow is gone (a placement it never took up, or an attempt it
    ran until it was terminated): its GPUs go back and the job ends."""

    job_id: str
    allocation_id: int
    started: bool = False  # the workflow had taken it up (a stop order could not reach it)
    workflow_id_prefix: str = ""  # where the job's workflow is asked about before anything ends
