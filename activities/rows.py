"""Database rows ↔ gpusched models: the scheduling snapshot, job views and admission rules.

Pure functions over plain mappings (asyncpg records), so they are tested without a database.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping

from pydantic import ValidationError

from scheduler.fleet import MAX_NAME_CHARS, name_problem
from scheduler.forecast import expected_arrivals
from scheduler.quotas import no_quota_refusal, over_max_refusal, queue_cap_refusal
from scheduler.models import (
    Earmark,
    JobSpec,
    Machine,
    PolicyConfig,
    Quota,
    QueuedJob,
    RunningJob,
    Snapshot,
)
from scheduler.never_fits import fewest_machines, why_it_never_fits
from workflows.types import (
    ATTEMPT_ORDERS_MAX,
    Admission,
    AttemptView,
    CheckpointView,
    EndReason,
    GpuGrant,
    HostGrant,
    JobRequest,
    JobView,
    PlacementOrder,
    PlacementSignal,
    PreemptOrder,
    PreemptSignal,
    command_bytes,
    env_bytes,
    request_problem,
)

log = logging.getLogger(__name__)

Row = Mapping[str, Any]


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds")


def json_value(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# --- the snapshot -------------------------------------------------------------------------------


def job_spec(request: Row | JobRequest, priority: str | None = None) -> JobSpec:
    req = request if isinstance(request, JobRequest) else JobRequest.model_validate(json_value(request))
    return JobSpec(
        job_id=req.job_id,
        team=req.team,
        num_gpus=req.num_gpus,
        gpu_type=req.gpu_type,
        gpu_memory_gb=req.gpu_memory_gb,
        topology=req.topology,
        priority=priority or req.priority,
        deadline=req.deadline,
        checkpoint_interval=req.checkpoint_interval,
        expected_duration=req.expected_duration,
        kind=req.kind,
        cluster=req.cluster,
    )


def split_path(path: str) -> tuple[str, int]:
    """``c1/b0/r0/m0/3`` → (``c1/b0/r0/m0``, 3)."""
    machine, _, index = path.rpartition("/")
    return machine, int(index)


def quota(row: Row) -> Quota:
    return Quota(guaranteed=row["guaranteed"], max=row["max_gpus"], queue_cap=row["queue_cap"])


def policy(lock: Row, learned_restart: float | None = None) -> PolicyConfig:
    """The cluster's policy: its overrides of the defaults; `expected_restart_s`, unless the
    cluster sets it, is what its resumed jobs took to start again lately (`learned_restart`)."""
    overrides = json_value(lock["policy"])
    if learned_restart is not None and "expected_restart_s" not in overrides:
        overrides = {**overrides, "expected_restart_s": learned_restart}
    while True:
        try:
            return PolicyConfig(**overrides)
        except ValidationError as e:
            # An override stored by an older release whose bounds were wider: the cycle must
            # still run, so that knob takes its default until `cluster set` gives it a new value.
            bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]} & overrides.keys()
            if not bad:
                raise
            log.warning("cluster policy: ignoring %s (%s); run `gpusched cluster set` to fix it",
                        ", ".join(f"{k}={overrides[k]!r}" for k in sorted(bad)), e.errors()[0]["msg"])
            overrides = {k: v for k, v in overrides.items() if k not in bad}


class Reuse:
    """The models built from one cluster's last snapshot, handed out again for rows that come back
    unchanged.

    A cycle reads every machine, running job and queued job of its cluster, and most are as they
    were a cycle ago. Handing the core the very same objects saves building them again, and lets
    what the core remembers per object (the fleet's layout, each running job's GPUs by machine)
    serve the live loop as it serves the simulator. A row is reused only when every one of its
    values is equal to last time's."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, Any], tuple[tuple, Any]] = {}
        self._seen: dict[tuple[str, Any], tuple[tuple, Any]] = {}

    def model(self, kind: str, key: Any, row: Row, build: Callable[[Row], Any]) -> Any:
        values = tuple(row.values())
        found = self._last.get((kind, key))
        if found is None or found[0] != values:
            found = (values, build(row))
        self._seen[(kind, key)] = found
        return found[1]

    def done(self) -> None:
        """Forget the rows this snapshot did not read (ended jobs, machines gone)."""
        self._last, self._seen = self._seen, {}


def machine(m: Row) -> Machine:
    return Machine(id=m["id"], cluster=m["cluster"], block=m["block"], rack=m["rack"], gpus=m["gpus"],
                   gpu_type=m["gpu_type"], gpu_memory_gb=m["gpu_memory_gb"], partition=m["partition"],
                   reachable=m["reachable"], unhealthy_gpus=frozenset(m["unhealthy"]), takes_work=m["takes_work"],
                   drain=m["drain"])


def running_job(r: Row) -> RunningJob:
    return RunningJob(
        spec=job_spec(r["request"], r["priority"]),
        submit_time=r["submit_time"],
        gpus=tuple(split_path(p) for p in r["gpus"]),
        started_at=r["started_at"] if r["started_at"] is not None else r["placed_at"],
        progress_at_start=r["progress_at_start"],
        preemptions=tuple(r["preemptions"]),
        checkpoint_phase=r["checkpoint_phase"],
        draining_until=r["draining_until"],
        preempted_for=r["preempted_for"],
        last_checkpoint_at=r["last_checkpoint_at"],
    )


def queued_job(j: Row) -> QueuedJob:
    return QueuedJob(spec=job_spec(j["request"], j["priority"]), submit_time=j["submit_time"],
                     queued_since=max(j["queued_since"], j["submit_time"]), progress=j["progress"],
                     preemptions=tuple(j["preemptions"]))


def snapshot(*, cluster: str, now: float, lock: Row, config: PolicyConfig, machines: Iterable[Row],
             running: Iterable[Row], queue: Iterable[Row], quotas: Iterable[Row],
             submissions: Iterable[Row] = (), reuse: Reuse | None = None) -> Snapshot:
    """`config` is `policy(lock)`, read once by the caller: it also says which submissions to read.
    `reuse`: the cluster's models from its last snapshot (none: every model is built afresh)."""
    reuse = reuse or Reuse()
    snap = Snapshot(
        cluster=cluster,
        now=now,
        machines=tuple(reuse.model("machine", m["id"], m, machine) for m in machines),
        running=tuple(reuse.model("running", r["allocation_id"], r, running_job) for r in running),
        queue=tuple(reuse.model("queued", j["id"], j, queued_job) for j in queue),
        quotas={r["team"]: quota(r) for r in quotas},
        earmarks=tuple(Earmark.model_validate(e) for e in json_value(lock["earmarks"])),
        config=config,
        expected_arrivals=expected_arrivals(
            ((s["submit_time"], s["priority"], s["num_gpus"], s["expected_duration"]) for s in submissions),
            now, config),
    )
    reuse.done()
    return snap


def placement_order(row: Row, grace_period: float) -> PlacementOrder:
    hosts: dict[str, list[GpuGrant]] = defaultdict(list)
    for path in row["gpus"]:
        machine, index = split_path(path)
        hosts[machine].append(GpuGrant(index=index, path=path))
    return PlacementOrder(
        job_id=row["job_id"],
        signal=PlacementSignal(
            allocation_id=row["id"],
            hosts=[HostGrant(machine_id=m, gpus=g) for m, g in hosts.items()],
            attempt=row["attempt"],
            grace_period=grace_period,
            checkpoint_phase=row["checkpoint_phase"],
            reason=row["placed_reason"] or "",  # the history says why it was placed there
        ),
    )


def preempt_order(row: Row, now: float) -> PreemptOrder:
    return PreemptOrder(
        job_id=row["job_id"],
        signal=PreemptSignal(allocation_id=row["id"], grace_period=max(0.0, row["draining_until"] - now),
                             reason=row["preempt_reason"] or "preempted",
                             end_reason=EndReason(row["preempt_end"] or EndReason.preempted.value)),
    )


def _shown(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most] + "…"


UNKNOWN_GPU_TYPE = "unknown"  # what an agent reports of a GPU NVML gave no name for


def machine_id_problem(machine_id: str) -> str | None:
    """Why `machine_id` cannot be a machine's id (its topology path), or None."""
    parts = machine_id.split("/")
    if len(parts) != 4 or not all(parts):
        return f"machine id '{_shown(machine_id)}' is not a topology path cluster/block/rack/machine"
    for what, part in zip(("cluster", "block", "rack", "machine"), parts):
        # A blank cluster would sort first and take the jobs submitted for any cluster.
        if name_problem(part) is not None:
            return (f"machine id '{_shown(machine_id)}': its {what} name {_shown(part)!r} is not a name; "
                    f"each of cluster/block/rack/machine is up to {MAX_NAME_CHARS} printable characters "
                    "without spaces, as in the fleet file")
    return None


def machine_from_report(machine_id: str, gpus: list) -> Machine:
    """A machine that joins by heartbeat: its id is its topology path."""
    if (problem := machine_id_problem(machine_id)) is not None:
        raise ValueError(problem)
    parts = machine_id.split("/")
    gpu_type, memory_gb = reported_type(gpus)
    # GPUs 0 to the highest index reported; those not reported are marked missing.
    count = max((g.index for g in gpus), default=0) + 1
    return Machine(id=machine_id, cluster=parts[0], block=parts[1], rack=parts[2], gpus=count,
                   gpu_type=gpu_type or UNKNOWN_GPU_TYPE, gpu_memory_gb=memory_gb or 80.0)


def reported_type(gpus: list) -> tuple[str | None, float | None]:
    """A machine's GPU type and memory from its heartbeat: the type most of its GPUs report (the
    lowest index's among equals), not GPU 0's alone, which reads "unknown" when NVML could not
    open it as the agent started; and the memory of the first GPU of that type to report one.
    (None, None) when no GPU reports a type."""
    named = sorted((g for g in gpus if g.gpu_type and g.gpu_type != UNKNOWN_GPU_TYPE), key=lambda g: g.index)
    if not named:
        return None, None
    counts = Counter(g.gpu_type for g in named)
    gpu_type = max(counts, key=lambda t: counts[t])  # max keeps the first of equals: the lowest index's
    return gpu_type, next((g.memory_gb for g in named if g.gpu_type == gpu_type and g.memory_gb), None)


# --- views --------------------------------------------------------------------------------------


def attempt_view(row: Row) -> AttemptView:
    return AttemptView(
        attempt=row["attempt"],
        allocation_id=row["id"],
        gpus=list(row["gpus"]),
        started_at=iso(row["started_at"]),
        ended_at=iso(row["ended_at"]),
        end_reason=row["end_reason"],
        resumed_from=row["resumed_from"],
        restart_s=row["restart_s"],
        stopping=row["preempt_reason"] if row["ended_at"] is None else None,
        stop_by=iso(row["draining_until"]) if row["ended_at"] is None else None,
    )


def checkpoint_view(row: Row) -> CheckpointView:
    return CheckpointView(seq=row["seq"], complete=row["complete"], size=row["size"],
                          created_at=iso(row["created_at"]), key=row["key"], progress=row["progress"],
                          allocation_id=row["allocation_id"], reason=row["reason"],
                          deleted=row["deleted_at"] is not None)


def job_view(job: Row, attempts: Iterable[Row], checkpoints: Iterable[Row] = ()) -> JobView:
    request = JobRequest.model_validate(json_value(job["request"]))
    return JobView(
        job_id=job["id"],
        team=job["team"],
        priority=job["priority"],
        state=job["state"],
        num_gpus=job["num_gpus"],
        cluster=job["cluster"],
        command=request.command,
        submitted_at=iso(job["submit_time"]),
        exit_code=job["exit_code"],
        reason=job["reason"] if job["reason"] else job["pending_reason"],
        pending_reason=job["pending_reason"] if job["state"] == "queued" else None,
        position=job["position"],
        estimated_start=iso(job["estimated_start"]),
        deadline=iso(request.deadline),
        misses_deadline=job["misses_deadline"] if job["state"] == "queued" else None,
        preemptions=len(job["preemptions"] or ()),
        attempts=[attempt_view(a) for a in attempts],
        checkpoints=[checkpoint_view(c) for c in checkpoints],
    )


# --- admission ----------------------------------------------------------------------------------


def admission_verdict(request: JobRequest, quota_row: Row | None, capacity: Iterable[Row], waiting: int):
    """Whether a job may join a queue, and which cluster's; the reason names the field and fix."""
    def refuse(field: str, reason: str) -> Admission:
        return Admission(accepted=False, job_id=request.job_id, field=field, reason=reason)

    problem = request_problem(request)
    if problem is not None:
        return refuse(problem[0], problem[1])
    team = request.team
    if quota_row is None:
        return refuse("team", no_quota_refusal(team))
    if quota_row["max_gpus"] is not None and request.num_gpus > quota_row["max_gpus"]:
        return refuse("num_gpus", over_max_refusal(team, request.num_gpus, quota_row["max_gpus"]))
    if quota_row["queue_cap"] is not None and waiting >= quota_row["queue_cap"]:
        return refuse("team", queue_cap_refusal(team, waiting, quota_row["queue_cap"]))
    by_cluster: dict[str, list[Row]] = defaultdict(list)
    for m in capacity:
        by_cluster[m["cluster"]].append(m)
    if request.cluster is not None and request.cluster not in by_cluster:
        known = ", ".join(sorted(by_cluster)) or "none"
        return refuse("cluster", f"unknown cluster '{request.cluster}' (known: {known})")
    candidates = [request.cluster] if request.cluster else sorted(by_cluster)
    reasons, fields = [], set()
    for name in candidates:
        why_not = _why_it_cannot_fit(request, by_cluster[name])
        if why_not is None:
            return Admission(accepted=True, job_id=request.job_id, cluster=name, reason="accepted")
        fields.add(why_not[0])
        reasons.append(f"{name}: {why_not[1]}")
    field = next((f for f in ("kind", "gpu_type", "gpu_memory_gb", "command", "env") if f in fields), "num_gpus")
    return refuse(field, "no cluster can ever host this job (" + "; ".join(reasons or ["no machines"]) + ")")


def _why_it_cannot_fit(request: JobRequest, machines: list[Row]) -> tuple[str, str] | None:
    """(the request field at fault, why) when no machine of the cluster can ever host the job,
    or when its run orders could never go out."""
    shapes = [SimpleNamespace(**m) for m in machines]
    if (why_not := why_it_never_fits(request, shapes)) is not None:
        return why_not
    return _orders_too_big(request, fewest_machines(request, shapes))


def _orders_too_big(request: JobRequest, machines: int) -> tuple[str, str] | None:
    """Each machine of a gang is sent the command and env: where even the fewest machines the
    job can span would take more than an attempt's orders may, the job could never start (its
    workflow would fail it when placed, hours later maybe)."""
    command, env = command_bytes(request), env_bytes(request)
    if machines * (command + env) <= ATTEMPT_ORDERS_MAX:
        return None
    return ("command" if command >= env else "env",
            f"its command and env, {(command + env) / 1024:.0f} KiB, go to each of the {machines} machines "
            f"or more its {request.num_gpus} GPUs span: over the {ATTEMPT_ORDERS_MAX // 2**20} MiB a job's "
            "history can take for one attempt; make them smaller (put the arguments in a file the command "
            "reads)")
