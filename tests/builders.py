"""A small fluent vocabulary for building scheduler inputs in tests.

    job("a").gpus(8).team("vision").priority("high").submitted(0).queued()
    running(job("b").gpus(2)).on("c1/b0/r0/m0", [0, 1]).started(100)
    fleet(blocks=2, racks=2, machines=4, gpus=8)
    snapshot(machines, running=[...], queue=[...], quotas={...}, now=10_000)
    cycle(snap)   # run_cycle, and check that the snapshot was not changed

Defaults are chosen so that a test only states what it is about: a job asks for 1 GPU of team
"t", class normal, expects to run an hour and checkpoints every 30 minutes; a running job started
at 0; a snapshot is taken at ``NOW`` (10,000 s), long after every default start, so running jobs
are past the minimum runtime unless a test says otherwise.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduler.cycle import run_cycle
from scheduler.models import (
    CycleResult,
    Earmark,
    ExpectedArrival,
    GpuSlot,
    JobKind,
    JobSpec,
    Machine,
    Pending,
    Placement,
    PolicyConfig,
    Priority,
    QueuedJob,
    Quota,
    RunningJob,
    Snapshot,
    Topology,
)

NOW = 10_000.0


def examples(n: int) -> int:
    """How many examples a property test draws: `n`, times HYPOTHESIS_SCALE when that is set. The
    suite keeps to its minutes with `n`; a deep run, `HYPOTHESIS_SCALE=80 scripts/test
    tests/test_cycle_properties.py`, is how two faults of the core were found (docs/history.md)."""
    scale = os.environ.get("HYPOTHESIS_SCALE", "1")
    if not scale.isdigit() or int(scale) < 1:
        raise ValueError(f"HYPOTHESIS_SCALE={scale!r}: give a whole number of times the examples, 1 or more")
    return n * int(scale)
CLUSTER = "c1"


def mid(block: int | str = 0, rack: int = 0, machine: int = 0, cluster: str = CLUSTER) -> str:
    """A machine id as fleet() names it: mid(0, 1, 2) == "c1/b0/r1/m2"."""
    b = block if isinstance(block, str) else f"b{block}"
    return f"{cluster}/{b}/r{rack}/m{machine}"


# --- jobs ------------------------------------------------------------------------------------


@dataclass
class JobBuilder:
    job_id: str
    _fields: dict = field(default_factory=dict)
    _submit: float = 0.0

    def _set(self, **kw) -> JobBuilder:
        self._fields.update(kw)
        return self

    def gpus(self, n: int) -> JobBuilder:
        return self._set(num_gpus=n)

    def team(self, name: str) -> JobBuilder:
        return self._set(team=name)

    def priority(self, p: str | Priority) -> JobBuilder:
        return self._set(priority=Priority(p))

    def topology(self, t: str | Topology | None) -> JobBuilder:
        return self._set(topology=None if t is None else Topology(t))

    def deadline(self, t: float | None) -> JobBuilder:
        return self._set(deadline=t)

    def checkpoint(self, interval: float | None) -> JobBuilder:
        return self._set(checkpoint_interval=interval)

    def no_checkpoint(self) -> JobBuilder:
        return self._set(checkpoint_interval=None)

    def expected(self, seconds: float) -> JobBuilder:
        return self._set(expected_duration=seconds)

    def kind(self, k: str | JobKind) -> JobBuilder:
        return self._set(kind=JobKind(k))

    def inference(self) -> JobBuilder:
        return self.kind("inference")

    def gpu_type(self, t: str | None) -> JobBuilder:
        return self._set(gpu_type=t)

    def submitted(self, t: float) -> JobBuilder:
        self._submit = t
        return self

    def spec(self) -> JobSpec:
        values = {
            "job_id": self.job_id,
            "team": "t",
            "num_gpus": 1,
            "priority": Priority.normal,
            "expected_duration": 3600.0,
            "checkpoint_interval": 1800.0,
        }
        values.update(self._fields)
        return JobSpec(**values)

    def queued(self, since: float | None = None, progress: float = 0.0,
               preemptions: Sequence[float] = ()) -> QueuedJob:
        return QueuedJob(
            spec=self.spec(),
            submit_time=self._submit,
            queued_since=self._submit if since is None else since,
            progress=progress,
            preemptions=tuple(preemptions),
        )


def job(job_id: str) -> JobBuilder:
    return JobBuilder(job_id)


def _spec_of(j: JobBuilder | JobSpec | QueuedJob) -> JobSpec:
    if isinstance(j, JobBuilder):
        return j.spec()
    if isinstance(j, QueuedJob):
        return j.spec
    return j


@dataclass
class RunningBuilder:
    spec: JobSpec
    _gpus: list[GpuSlot] = field(default_factory=list)
    _started: float = 0.0
    _submit: float | None = None
    _fields: dict = field(default_factory=dict)

    def on(self, machine: str, gpus: Iterable[int]) -> RunningBuilder:
        self._gpus.extend((machine, g) for g in gpus)
        return self

    def started(self, t: float) -> RunningBuilder:
        self._started = t
        return self

    def submitted(self, t: float) -> RunningBuilder:
        self._submit = t
        return self

    def checkpointed(self, t: float | None) -> RunningBuilder:
        self._fields["last_checkpoint_at"] = t
        return self

    def resumed_from(self, progress: float) -> RunningBuilder:
        self._fields["progress_at_start"] = progress
        return self

    def preempted_at(self, *times: float) -> RunningBuilder:
        self._fields["preemptions"] = tuple(times)
        return self

    def phase(self, p: float | None) -> RunningBuilder:
        self._fields["checkpoint_phase"] = p
        return self

    def draining(self, until: float, for_job: str | None = None) -> RunningBuilder:
        self._fields["draining_until"] = until
        self._fields["preempted_for"] = for_job
        return self

    def build(self) -> RunningJob:
        if len(self._gpus) != self.spec.num_gpus:
            raise ValueError(
                f"running job {self.spec.job_id} asks {self.spec.num_gpus} GPUs but is on {len(self._gpus)}"
            )
        submit = self._submit if self._submit is not None else min(self._started, 0.0)
        return RunningJob(spec=self.spec, submit_time=submit, gpus=tuple(self._gpus),
                          started_at=self._started, **self._fields)


def running(j: JobBuilder | JobSpec | QueuedJob) -> RunningBuilder:
    return RunningBuilder(_spec_of(j))


def filler(job_id: str, machine: str, gpus: Iterable[int], *, priority: str = "critical",
           team: str = "ops", started: float = 0.0, expected: float = 3600.0) -> RunningBuilder:
    """A running job that only occupies GPUs (critical by default, so nobody preempts it)."""
    gpus = list(gpus)
    spec = job(job_id).gpus(len(gpus)).priority(priority).team(team).expected(expected)
    return running(spec).on(machine, gpus).started(started)


def ends_in(seconds: float, job_id: str, machine: str, gpus: Iterable[int]) -> RunningBuilder:
    """A job nobody displaces (a filler) expected to end `seconds` from now."""
    return filler(job_id, machine, gpus).started(NOW - 3600.0 + seconds)


# --- machines --------------------------------------------------------------------------------


def fleet(blocks: int = 1, racks: int = 1, machines: int = 1, gpus: int = 8, *, cluster: str = CLUSTER,
          first_block: int = 0, gpu_type: str = "H100", gpu_memory_gb: float = 80.0,
          partition: str = "training") -> list[Machine]:
    """blocks × racks × machines identical machines named cluster/bN/rN/mN."""
    out = []
    for b in range(first_block, first_block + blocks):
        for r in range(racks):
            for m in range(machines):
                out.append(Machine(id=mid(b, r, m, cluster), cluster=cluster, block=f"b{b}", rack=f"r{r}",
                                   gpus=gpus, gpu_type=gpu_type, gpu_memory_gb=gpu_memory_gb,
                                   partition=partition))
    return out


def unreachable(machines: Sequence[Machine], *ids: str) -> list[Machine]:
    return [m.model_copy(update={"reachable": False}) if m.id in ids else m for m in machines]


def silent(machines: Sequence[Machine], *ids: str) -> list[Machine]:
    """Machines whose agent owes an answer: reachable, but taking no work."""
    return [m.model_copy(update={"takes_work": False}) if m.id in ids else m for m in machines]


def cordoned(machines: Sequence[Machine], *ids: str) -> list[Machine]:
    """Machines an operator cordoned (`gpusched fleet cordon`): as the store gives them, taking no work."""
    return silent(machines, *ids)


def drained(machines: Sequence[Machine], *ids: str) -> list[Machine]:
    """Machines an operator drains (`gpusched fleet drain`): as the store gives them, taking no work."""
    return [m.model_copy(update={"takes_work": False, "drain": True}) if m.id in ids else m for m in machines]


def unhealthy(machines: Sequence[Machine], machine_id: str, gpus: Iterable[int]) -> list[Machine]:
    bad = frozenset(gpus)
    return [m.model_copy(update={"unhealthy_gpus": m.unhealthy_gpus | bad}) if m.id == machine_id else m
            for m in machines]


# --- snapshots and cycles ----------------------------------------------------------------------


def _built(x):
    return x.build() if hasattr(x, "build") else x


def _queued(x):
    return x.queued() if isinstance(x, JobBuilder) else x


def arrival(at: float, priority: str = "normal", gpus: int = 8, duration: float = 3600.0) -> ExpectedArrival:
    """Work the forecast expects to arrive at `at`."""
    return ExpectedArrival(at=at, priority=priority, num_gpus=gpus, expected_duration=duration)


def config(**overrides) -> PolicyConfig:
    return PolicyConfig(**overrides)


def snapshot(machines: Sequence[Machine], *, running: Sequence = (), queue: Sequence = (),
             quotas: dict | None = None, earmarks: Sequence[Earmark] = (), now: float = NOW,
             cfg: PolicyConfig | None = None, cluster: str = CLUSTER, arrivals: Sequence[ExpectedArrival] = (),
             **config_overrides) -> Snapshot:
    if cfg is None:
        cfg = PolicyConfig(**config_overrides)
    elif config_overrides:
        cfg = cfg.model_copy(update=config_overrides)
    return Snapshot(
        cluster=cluster,
        now=now,
        machines=tuple(machines),
        running=tuple(_built(r) for r in running),
        queue=tuple(_queued(q) for q in queue),
        quotas={team: (q if isinstance(q, Quota) else Quota(**q)) for team, q in (quotas or {}).items()},
        earmarks=tuple(earmarks),
        config=cfg,
        expected_arrivals=tuple(arrivals),
    )


def cycle(snap: Snapshot) -> CycleResult:
    """Run one cycle and check the snapshot came back exactly as it went in."""
    before_dump = snap.model_dump()
    before_copy = copy.deepcopy(snap)
    result = run_cycle(snap)
    assert snap.model_dump() == before_dump, "the cycle changed its snapshot"
    assert snap == before_copy, "the cycle changed its snapshot"
    return result


# --- reading results -------------------------------------------------------------------------


def placements(result: CycleResult) -> dict[str, Placement]:
    return {p.job_id: p for p in result.placements}


def pending(result: CycleResult) -> dict[str, Pending]:
    return {p.job_id: p for p in result.pending}


def pending_order(result: CycleResult) -> list[str]:
    return [p.job_id for p in sorted(result.pending, key=lambda p: p.position)]


def preempted(result: CycleResult) -> list[str]:
    return [p.job_id for p in result.preemptions]


def machines_of(gpus: Iterable[GpuSlot]) -> set[str]:
    return {m for m, _ in gpus}


def blocks_of(gpus: Iterable[GpuSlot]) -> set[str]:
    return {m.split("/")[1] for m, _ in gpus}


def after_preemption(snap: Snapshot, result: CycleResult, *, now: float | None = None,
                     victims_gone: bool = True) -> Snapshot:
    """The next snapshot as the live loop would build it: earmarks passed back, jobs whose machine
    died gone, and the victims either gone (their GPUs free) or still draining for the claimant."""
    lost = {r.job_id for r in result.requeues if not r.graceful}
    victims = {p.job_id: p for p in result.preemptions}
    placed = {p.job_id: p for p in result.placements}
    t = snap.now if now is None else now
    still, requeued = [], []
    for r in snap.running:
        if r.spec.job_id in lost:
            continue
        if r.spec.job_id in victims:
            if victims_gone:  # checkpointed and back in the queue, as the live loop requeues it
                requeued.append(QueuedJob(spec=r.spec, submit_time=r.submit_time, queued_since=t,
                                          progress=r.progress_at_start, preemptions=r.preemptions + (snap.now,)))
                continue
            p = victims[r.spec.job_id]
            r = r.model_copy(update={"draining_until": snap.now + p.grace_period, "preempted_for": p.for_job,
                                     "preemptions": r.preemptions + (snap.now,)})
        still.append(r)
    queue = []
    for q in snap.queue:
        p = placed.get(q.spec.job_id)
        if p is None:
            queue.append(q)
        else:
            still.append(RunningJob(spec=q.spec, submit_time=q.submit_time, gpus=p.gpus, started_at=snap.now,
                                    progress_at_start=q.progress, preemptions=q.preemptions,
                                    checkpoint_phase=p.checkpoint_phase))
    queue += requeued
    return snap.model_copy(update={"now": t, "running": tuple(still), "queue": tuple(queue),
                                   "earmarks": result.earmarks})
