"""The Postgres port: everything gpusched keeps in its system of record, behind named methods.

SQL lives in ``queries.py``; the row ↔ model conversions of a scheduling snapshot live in
``rows.py``. Driver errors that callers must tell apart become ``StoreError`` subclasses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import Counter
from contextlib import ExitStack
from importlib import resources
from typing import Annotated, Callable

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from activities import queries as q
from activities import rows
from activities.outages import log_outages_in_one_line
from scheduler import in_words
from scheduler.fleet import MAX_GPU_TYPE_CHARS, Fleet
from scheduler.gc_policy import no_collections
from scheduler.models import CycleResult, Machine, PolicyConfig, Quota, Snapshot
from workflows.types import (
    HEARD,
    SILENT,
    UNSURE,
    Admission,
    AttemptView,
    CheckpointAck,
    CheckpointReport,
    CheckpointView,
    CycleOutcome,
    EndReason,
    JobRequest,
    JobState,
    JobView,
    request_problem,
)


@functools.cache
def _migration_files() -> tuple:
    """The shipped migrations, in order: read once (every /healthz asks which are applied)."""
    return tuple(sorted((f for f in resources.files("activities.migrations").iterdir() if f.name.endswith(".sql")),
                        key=lambda f: f.name))


# What to do about a database without (all of) the schema, in words.
UNMIGRATED_FIX = ("start a control worker (`python -m workers.control`, or `gpusched dev up`): it migrates the "
                  "database before it serves")


# A migration's statement waits this long for a table's lock, then its transaction is rolled back
# and tried again later: an ALTER TABLE queued behind a long transaction (a report, a stuck
# session) would otherwise make every later query on that table queue behind it, and the
# scheduler, its API and its agents stall for as long as that transaction lasts.
MIGRATION_LOCK_WAIT_S = 2.0
MIGRATION_PATIENCE_S = 120.0  # tries a blocked migration again this long before giving up
MIGRATION_RETRY_AT_MOST_S = 5.0

# Far above any transaction of ours (a cycle's is its planning, milliseconds to seconds).
IDLE_IN_TRANSACTION_S = 300.0
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3


def _again_after_a_migration(method):
    """Run a transaction of whole rows (`SELECT *`) once more when a migration has changed a table
    under a statement this process prepared before it: Postgres refuses the stale statement, which
    aborts the transaction (outside one asyncpg prepares it again by itself), and asyncpg has by
    then dropped every connection's prepared statements. Without it, a rolling upgrade failed the
    first start, checkpoint report or admission of each process."""
    @functools.wraps(method)
    async def once_more(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except asyncpg.InvalidCachedStatementError:
            return await method(*args, **kwargs)
    return once_more


class StoreError(Exception):
    pass


class CycleConflict(StoreError):
    """Another transaction changed what the cycle read; the cycle is run again from a new read."""


class MigrationBlocked(StoreError):
    """A migration could not take a table's lock within the patience: another session holds it."""


class FleetApplied(BaseModel):
    """What `Store.apply_fleet` changed, and what it left alone."""

    added: list[str] = Field(default_factory=list)  # machines new to the store
    moved: list[str] = Field(default_factory=list)  # "id (old -> new partition)"
    quotas: list[str] = Field(default_factory=list)  # teams whose quota the file set
    undeclared: list[str] = Field(default_factory=list)  # machines of its clusters the file leaves out


class GpuReport(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)
    index: int = Field(ge=0, le=1023)  # what CUDA_VISIBLE_DEVICES names: never negative
    gpu_type: str | None = Field(default=None, max_length=MAX_GPU_TYPE_CHARS)
    memory_gb: float | None = Field(default=None, ge=0)  # 0: NVML could not say
    healthy: bool = True
    faults: list[Annotated[str, Field(max_length=200)]] = Field(default=[], max_length=64)


log = logging.getLogger("gpusched.store")
Planner = Callable[[Snapshot], CycleResult]
# Orders not acted on this long after the cycle that made them are sent again, and then at
# twice the last wait each time, up to RESEND_AT_MOST apart: a placement is taken up within
# seconds, but a stop only when its attempt ends, a grace period later or more.
RESEND_AFTER = 3.0
RESEND_AT_MOST = 60.0
# The most bytes of orders one cycle answers with; the rest wait for the next cycles. Temporal
# refuses an activity result over 2 MiB: a cycle of ~5,000 placements was committed, recorded as
# sent, refused on upload, and rebuilt whole at every resend: its jobs stayed placed for good.
ORDERS_BYTES_MAX = 1 << 20
# Every API process says it hears heartbeats this often; nobody saying it for LISTEN_GAP seconds
# means the control plane was deaf, and machines' silence over that time is no evidence.
LISTEN_EVERY = 1.0
LISTEN_GAP = 3.0
# An attempt that ended for want of its agent leaves a machine owing an answer only if the agent
# has been quiet this long (over two of its 2 s heartbeat intervals): the gang's other machines,
# or the machine of a job that died of its GPU, have heard from their agents just now.
QUIET_S = 5.0
# How long a machine takes no new work after an attempt placed there was not picked up though
# its agent heartbeated (the agent's worker does not poll): long enough for the jobs to go
# elsewhere, short enough that a passing hiccup costs little capacity.
UNPICKED_COOL_DOWN = 300.0
HELD_BACK_MAX = 3600.0  # however many failures in a row: a job is never held back longer


def held_back(backoff: float, failures_in_a_row: int) -> float:
    """How long a job queued again after its `failures_in_a_row`-th infrastructure failure in a
    row waits before it may be placed: nothing after the first (its machine died: another one
    will do), then `backoff`, doubled with each failure after (60 s, 2 min, 4 min by default)."""
    if failures_in_a_row < 2 or backoff <= 0:
        return 0.0
    return min(HELD_BACK_MAX, backoff * 2 ** min(failures_in_a_row - 2, 20))


def hearing_verdict(silent_for: float | None, unsaid_for: float | None, listened_for: float | None,
                    within: float) -> str:
    """Whether the control plane heard a machine within ``within`` seconds (HEARD), or heard it
    silent for longer while it listened (SILENT), or cannot tell (UNSURE): nobody says it hears
    now (the API or the database is down), or it has listened again for less than ``within``
    since a break and has not heard the machine since. Seconds ago, each; None: never heard, or
    no API ever ran (then silence alone decides)."""
    if unsaid_for is not None and unsaid_for > LISTEN_GAP:
        return UNSURE
    if silent_for is not None and silent_for <= within:
        return HEARD
    silence = min(math.inf if silent_for is None else silent_for, math.inf if listened_for is None else listened_for)
    return SILENT if silence > within else UNSURE


class Store:
    def __init__(self, pool: asyncpg.Pool):
        self.pool = pool
        self.reuse: dict[str, rows.Reuse] = {}  # per cluster: the models of its last snapshot

    @classmethod
    async def connect(cls, dsn: str, min_size: int = 1, max_size: int = 10, timeout: float = 60.0,
                      idle_in_transaction: float = IDLE_IN_TRANSACTION_S) -> "Store":
        log_outages_in_one_line()
        # A process that dies, hangs or loses its network inside a transaction would hold its
        # locks (a cluster's cycle lock, jobs' rows) until the server's TCP gave up: two hours of
        # no cycles for that cluster. The server ends such a session instead: a silent peer within
        # about a minute, a live one idle in its transaction past the limit. Given at connection
        # (not SET): the pool's RESET ALL on each release would undo a SET.
        server_settings = {
            "idle_in_transaction_session_timeout": str(max(1, round(idle_in_transaction * 1000))),
            "tcp_keepalives_idle": str(KEEPALIVE_IDLE_S),
            "tcp_keepalives_interval": str(KEEPALIVE_INTERVAL_S),
            "tcp_keepalives_count": str(KEEPALIVE_COUNT),
        }
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_connection,
                                         timeout=timeout, server_settings=server_settings)
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def now(self) -> float:
        return await self.pool.fetchval(q.NOW)

    # --- migrations -------------------------------------------------------------------------

    async def migrate(self, *, lock_wait: float = MIGRATION_LOCK_WAIT_S,
                      patience: float = MIGRATION_PATIENCE_S) -> list[str]:
        """Apply the SQL files of ``activities/migrations`` not applied yet, in order, each in
        its own transaction; returns the names applied. MigrationBlocked if a table one of them
        changes stays locked by another session for `patience` seconds."""
        files = _migration_files()
        applied_now = []
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                # Under the lock too: two processes creating it at once on a fresh database race
                # in the catalogue (IF NOT EXISTS does not serialise), and one fails.
                await conn.execute(q.LOCK_MIGRATIONS)
                await conn.execute(q.CREATE_MIGRATIONS_TABLE)
            for f in files:
                if await self._apply_migration(conn, f, lock_wait, patience):
                    applied_now.append(f.name)
        return applied_now

    async def _apply_migration(self, conn, f, lock_wait: float, patience: float) -> bool:
        """Apply one migration unless it is applied already; whether it was applied now. Its
        statements wait at most `lock_wait` for a lock (their transaction is then rolled back,
        releasing the lock queue behind it) and are tried again, with backoff, for `patience`."""
        version = int(f.name.split("_", 1)[0])
        deadline, delay = time.monotonic() + patience, 0.25
        while True:
            try:
                async with conn.transaction():
                    await conn.execute(q.LOCK_MIGRATIONS)
                    done = {r["version"] for r in await conn.fetch(q.APPLIED_MIGRATIONS)}
                    if version in done:
                        return False
                    await conn.execute(q.MIGRATION_LOCK_WAIT.format(ms=max(1, round(lock_wait * 1000))))
                    await conn.execute(f.read_text())
                    await conn.execute(q.RECORD_MIGRATION, version, f.name)
                    return True
            except asyncpg.LockNotAvailableError as e:
                if time.monotonic() + delay > deadline:
                    raise MigrationBlocked(
                        f"migration {f.name} could not lock a table it changes for {patience:.0f} s: another "
                        f"session holds it ({e}); find it in pg_stat_activity (pg_locks), end its transaction, "
                        "and start again (the control worker, or `gpusched dev up`)") from None
                log.warning("migration %s waits for a table another session has locked; trying again in %.2f s",
                            f.name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MIGRATION_RETRY_AT_MOST_S)

    async def unmigrated(self) -> list[str]:
        """The migrations this code needs that the database has not had (only the control
        worker migrates: the API and the CLI work on the schema it made)."""
        try:
            done = {r["version"] for r in await self.pool.fetch(q.APPLIED_MIGRATIONS)}
        except asyncpg.UndefinedTableError:
            done = set()
        return [f.name for f in _migration_files() if int(f.name.split("_", 1)[0]) not in done]

    # --- fleet ------------------------------------------------------------------------------

    async def register_fleet(self, cluster: str, machines: list[Machine], overwrite: bool = True) -> None:
        """The machines as given; ``overwrite=False``: only those not known yet (a known one keeps
        its type, memory and partition, as `fleet apply` or its agent left them)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(q.UPSERT_CLUSTER, cluster)
            for m in machines:
                await self._upsert_machine(conn, m, overwrite)

    async def _upsert_machine(self, conn, m: Machine, overwrite: bool = True) -> None:
        await conn.execute(q.UPSERT_CLUSTER, m.cluster)
        await conn.execute(q.UPSERT_MACHINE if overwrite else q.JOIN_MACHINE, m.id, m.cluster, m.block, m.rack,
                           m.gpu_type, m.gpu_memory_gb, m.partition)
        await conn.executemany(q.UPSERT_GPU, [(m.id, i) for i in range(m.gpus)])

    async def apply_fleet(self, fleet: Fleet) -> FleetApplied:
        """Declare a fleet file's machines and quotas, in one transaction. A machine not known
        yet joins as the file says; one already known keeps the GPUs, type and memory its agent
        reported and takes the file's partition. Machines the file leaves out are left alone."""
        applied = FleetApplied()
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(q.ORDER_AFTER_CYCLES)  # partitions and quotas: after the cycles in flight
            for cluster in fleet.clusters:
                await conn.execute(q.UPSERT_CLUSTER, cluster.name)
            # Machines' rows in id order, as an attempt's end marks them silent: in the file's
            # order (m9 before m10) the two deadlocked.
            for m in sorted((m for c in fleet.clusters for m in c.machines), key=lambda m: m.id):
                declared = await conn.fetchrow(q.DECLARE_MACHINE, m.id, m.cluster, m.block, m.rack, m.gpu_type,
                                               m.gpu_memory_gb, m.partition)
                if declared["inserted"]:
                    await conn.executemany(q.UPSERT_GPU, [(m.id, i) for i in range(m.gpus)])
                    applied.added.append(m.id)
                elif declared["before"] is not None and declared["before"] != m.partition:
                    applied.moved.append(f"{m.id} ({declared['before']} -> {m.partition})")
            teams = fleet.every_quota
            for team, quota in teams.items():
                await conn.execute(q.SET_QUOTA, team, quota.guaranteed, quota.max, quota.queue_cap)
            applied.quotas = sorted(teams)
            declared = {m.id for c in fleet.clusters for m in c.machines}
            for cluster in fleet.clusters:
                applied.undeclared += [r["id"] for r in await conn.fetch(q.MACHINE_IDS, cluster.name)
                                       if r["id"] not in declared]
        return applied

    async def machine_heartbeat(self, machine_id: str, pid: int | None, gpus: list[GpuReport],
                                accepting_work: bool = True) -> list[int]:
        """Record that the machine's agent is alive and how its GPUs are; a machine not seen
        before joins the fleet (its topology is its id, ``cluster/block/rack/machine``). Returns
        the allocations live on the machine: the agent kills any process not among them."""
        reported = [g.index for g in gpus]
        twice = sorted(i for i, n in Counter(reported).items() if n > 1)
        if twice:
            raise ValueError(f"the heartbeat reports GPU {', '.join(map(str, twice))} more than once; "
                             "each GPU once, by its index")
        async with self.pool.acquire() as conn, conn.transaction():
            gpu_type = await conn.fetchval(q.MACHINE_GPU_TYPE, machine_id)
            if gpu_type is None:
                if not gpus:
                    raise ValueError(f"machine '{machine_id}' is not known yet and its heartbeat reports no "
                                     "GPUs; a machine joins with a heartbeat that lists them")
                m = rows.machine_from_report(machine_id, gpus)
                await conn.execute(q.UPSERT_CLUSTER, m.cluster)
                joined = await conn.execute(q.JOIN_MACHINE, m.id, m.cluster, m.block, m.rack, m.gpu_type,
                                            m.gpu_memory_gb, m.partition) == "INSERT 0 1"
                # Not joined: a fleet file declared it meanwhile, and its partition stands (it was
                # overwritten with the default, and inference jobs never went there).
                gpu_type = None if joined else await conn.fetchval(q.MACHINE_GPU_TYPE, machine_id)
            if gpu_type == rows.UNKNOWN_GPU_TYPE and (named := rows.reported_type(gpus))[0] is not None:
                await conn.execute(q.NAME_UNKNOWN_MACHINE, machine_id, *named)
            # The machine's row before its GPUs' rows: two heartbeats of one machine at once (a
            # failing GPU's is sent beside the regular one) take their locks in one order.
            await conn.execute(q.RECORD_HEARTBEAT, machine_id, pid, accepting_work)
            if gpus:  # a heartbeat without GPUs says nothing about them
                # Every index up to the highest has a row (those not reported are then marked
                # missing): the scheduler numbers a machine's GPUs 0 to its count, and a hold on
                # an index with no row failed every cycle of the cluster's commit.
                await conn.execute(q.ADD_REPORTED_GPUS, machine_id, list(range(max(reported) + 1)))
                await conn.execute(q.MARK_UNREPORTED_GPUS, machine_id, reported)
            await conn.executemany(q.SET_GPU_HEALTH, [(machine_id, g.index, g.healthy, g.faults) for g in gpus])
            return [r[0] for r in await conn.fetch(q.LIVE_ALLOCATIONS_ON_MACHINE, machine_id)]

    async def live_allocations(self, cluster: str) -> list[dict]:
        """The cluster's allocations not yet ended: id, job id, state."""
        return [dict(r) for r in await self.pool.fetch(q.LIVE_ALLOCATIONS_OF_CLUSTER, cluster)]

    async def queued_jobs(self, cluster: str) -> list[str]:
        """The ids of the cluster's queued jobs."""
        return [r[0] for r in await self.pool.fetch(q.QUEUED_JOBS_OF_CLUSTER, cluster)]

    async def silent_for(self, machine_ids: list[str]) -> list[float | None]:
        """Seconds since each machine's agent last heartbeated, in order; None: never heard (or no
        such machine)."""
        silent = {r["id"]: r["silent_for"] for r in await self.pool.fetch(q.SILENT_FOR, machine_ids)}
        return [silent.get(m) for m in machine_ids]

    async def hearing(self, machine_ids: list[str], within: float) -> list[str]:
        """What the control plane has heard of each machine, in order (``hearing_verdict``)."""
        rows_by_id = {r["id"]: r for r in await self.pool.fetch(q.HEARING, machine_ids)}
        return [hearing_verdict(r["silent_for"], r["unsaid_for"], r["listened_for"], within) if r else SILENT
                for r in (rows_by_id.get(m) for m in machine_ids)]

    async def configure_cluster(self, cluster: str, policy: dict | None = None,
                                machine_timeout: float | None = None) -> None:
        await self.pool.execute(q.UPSERT_CLUSTER, cluster)
        await self.pool.execute(q.SET_CLUSTER_SETTINGS, cluster,
                                json.dumps(policy) if policy is not None else None, machine_timeout)

    async def set_cluster_policy(self, cluster: str, knobs: dict,
                                 machine_timeout: float | None = None) -> dict | None:
        """Set some of the cluster's policy knobs, keeping the others it overrides: the overrides
        now, or None for no such cluster. Read and written under a lock on the cluster's row, so
        two changes at once both stand (each read the overrides, then wrote its own over the
        other's). A ValidationError, and nothing written, where the knobs with the rest make no
        valid policy."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(q.CLUSTER_POLICY_FOR_UPDATE, cluster)
            if row is None:
                return None
            merged = {**(rows.json_value(row["policy"]) or {}), **knobs}
            policy = PolicyConfig(**merged)
            overrides = {k: getattr(policy, k) for k in merged}
            await conn.execute(q.SET_CLUSTER_SETTINGS, cluster, json.dumps(overrides), machine_timeout)
            return overrides

    async def capacity(self) -> list[dict]:
        """Every machine's place and size: what admission checks a job's shape against."""
        return [dict(r) for r in await self.pool.fetch(q.CLUSTER_CAPACITY)]

    async def clusters(self) -> list[dict]:
        """Each cluster's name, policy overrides, machine timeout and cycle counter."""
        return [{**dict(r), "policy": rows.json_value(r["policy"])} for r in await self.pool.fetch(q.LIST_CLUSTERS)]

    async def cluster_names(self) -> list[str]:
        return [r["name"] for r in await self.pool.fetch(q.LIST_CLUSTERS)]

    async def list_machines(self, cluster: str | None = None) -> list[dict]:
        return [dict(r) for r in await self.pool.fetch(q.LIST_MACHINES, cluster, LISTEN_GAP)]

    async def cordon(self, machine_id: str, mode: str | None, reason: str | None = None) -> int | None:
        """Take a machine out of service (`mode` 'cordoned': no new work, its jobs run on;
        'draining': its jobs are also asked to checkpoint and move) or put it back (None), after
        the cycles in flight: once this returns, no cycle places there. The number of
        allocations still on it; None when there is no such machine."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(q.ORDER_AFTER_CYCLES)
            return await conn.fetchval(q.SET_CORDON, machine_id, mode, reason if mode else None)

    async def listened(self) -> None:
        """An API process hears heartbeats (every ``LISTEN_EVERY`` seconds): machines' silence
        counts as evidence only while this goes on (migration 0005)."""
        await self.pool.execute(q.LISTENED, LISTEN_GAP)

    # --- quotas -----------------------------------------------------------------------------

    async def set_quota(self, team: str, quota: Quota) -> None:
        """Set a team's quota, after the cycles in flight (queries.ORDER_AFTER_CYCLES)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(q.ORDER_AFTER_CYCLES)
            await conn.execute(q.SET_QUOTA, team, quota.guaranteed, quota.max, quota.queue_cap)

    async def list_quotas(self) -> dict[str, Quota]:
        return {r["team"]: rows.quota(r) for r in await self.pool.fetch(q.LIST_QUOTAS)}

    # --- machine tokens ---------------------------------------------------------------------

    async def token_generations(self) -> dict[str, int]:
        """The generation of every machine token renewed at least once (the others are at 0)."""
        return {r["machine_id"]: r["generation"] for r in await self.pool.fetch(q.TOKEN_GENERATIONS)}

    async def machine_known(self, machine_id: str) -> bool:
        return bool(await self.pool.fetchval(q.MACHINE_EXISTS, machine_id))

    async def token_generation(self, machine_id: str) -> int:
        return await self.pool.fetchval(q.TOKEN_GENERATION, machine_id)

    async def renew_machine_token(self, machine_id: str) -> int:
        """Move a machine's token to its next generation, which refuses the one before; the new
        generation."""
        return await self.pool.fetchval(q.RENEW_MACHINE_TOKEN, machine_id)

    # --- jobs -------------------------------------------------------------------------------

    @_again_after_a_migration
    async def admit(self, request: JobRequest) -> Admission:
        """Accept a job into its cluster's queue, or refuse it with the reason and the field at
        fault. Idempotent: admitting a job id again answers as the first time did."""
        if (problem := request_problem(request)) is not None:
            # Before any query: a NUL in the team would make the first one fail, on every retry.
            return Admission(accepted=False, job_id=request.job_id, field=problem[0], reason=problem[1])
        async with self.pool.acquire() as conn, conn.transaction():
            # Before the job is looked for: a second admission of it waits for the first, and
            # then finds it admitted instead of counting it against the queue cap.
            await conn.execute(q.LOCK_TEAM_ADMISSIONS, request.team)
            existing = await conn.fetchrow(q.JOB, request.job_id)
            if existing is not None and JobState(existing["state"]).terminal:
                # Not a retry of this admission (its workflow waits on it): a new job under the
                # id of one that has ended, which would wait for ever for a placement.
                return Admission(accepted=False, job_id=request.job_id, field="job_id",
                                 reason=f"job id '{request.job_id}' belongs to a job that has ended "
                                        f"({existing['state']}); choose another id")
            if existing is not None:
                return Admission(accepted=True, job_id=request.job_id, cluster=existing["cluster"],
                                 reason="already admitted")
            quota_row = await conn.fetchrow(q.QUOTA, request.team)
            capacity = await conn.fetch(q.CLUSTER_CAPACITY)
            waiting = await conn.fetchval(q.TEAM_WAITING_JOBS, request.team)
            verdict = rows.admission_verdict(request, quota_row, capacity, waiting)
            if not verdict.accepted:
                await conn.execute(q.AUDIT, None, None, "refused", verdict.reason,
                                   json.dumps({"job_id": request.job_id, "field": verdict.field}))
                return verdict
            now = await conn.fetchval(q.NOW)
            # A submitter may say when it first asked (a pipeline resubmitting), never a future time.
            submit = now if request.submit_time is None else min(request.submit_time, now)
            inserted = await conn.execute(q.INSERT_JOB, request.job_id, request.team, verdict.cluster,
                                          request.model_dump_json(), request.priority.value, request.num_gpus,
                                          submit)
            if inserted != "INSERT 0 1":
                # Admitted meanwhile under another team's lock (the same id sent for two teams):
                # the job that has the id is that one.
                return Admission(accepted=False, job_id=request.job_id, field="job_id",
                                 reason=f"a job with id '{request.job_id}' already exists; choose another id")
            await conn.execute(q.AUDIT, verdict.cluster, request.job_id, "submitted", "accepted",
                               request.model_dump_json(include={"team", "num_gpus", "priority", "command"}))
            return verdict

    async def job_view(self, job_id: str) -> JobView | None:
        async with self.pool.acquire() as conn:
            job = await conn.fetchrow(q.JOB, job_id)
            if job is None:
                return None
            return rows.job_view(job, await conn.fetch(q.ATTEMPTS, [job_id]),
                                 await conn.fetch(q.JOB_CHECKPOINTS, job_id))

    async def list_jobs(self, team: str | None = None, state: str | None = None,
                        limit: int = 1000) -> list[JobView]:
        async with self.pool.acquire() as conn:
            given = [value for value in (team, state) if value is not None]
            jobs = await conn.fetch(q.LIST_JOBS[team is not None, state is not None], limit, *given)
            attempts: dict[str, list] = {}
            for a in await conn.fetch(q.ATTEMPTS, [j["id"] for j in jobs]):
                attempts.setdefault(a["job_id"], []).append(a)
            return [rows.job_view(j, attempts.get(j["id"], [])) for j in jobs]

    async def team_waiting(self, team: str) -> int:
        """How many of the team's jobs wait (queued or placed): what its queue cap counts."""
        return await self.pool.fetchval(q.TEAM_WAITING_JOBS, team)

    async def attempts(self, job_id: str) -> list[AttemptView]:
        return [rows.attempt_view(r) for r in await self.pool.fetch(q.ATTEMPTS, [job_id])]

    async def set_priority(self, job_id: str, priority: str) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            done = await conn.execute(q.SET_PRIORITY, job_id, priority) == "UPDATE 1"
            if done:
                await conn.execute(q.AUDIT, None, job_id, "priority", f"priority set to {priority}", "{}")
            return done

    async def mark_checkpointing(self, job_id: str) -> bool:
        """The job checkpoints before it stops: shown only while its attempt still drains."""
        return await self.pool.execute(q.MARK_JOB_CHECKPOINTING, job_id) == "UPDATE 1"

    async def mark_stopping(self, allocation_id: int, grace_period: float, reason: str) -> bool:
        """An attempt its job's cancel stops, with `grace_period` to checkpoint: said while it
        runs on (`AttemptView.stopping`). Not one ended, or told to stop already."""
        return await self.pool.execute(q.MARK_STOPPING, allocation_id, grace_period, reason) == "UPDATE 1"

    async def audit_trail(self, job_id: str) -> list[dict]:
        return [dict(r) for r in await self.pool.fetch(q.AUDIT_OF_JOB, job_id)]

    # --- attempts ---------------------------------------------------------------------------

    @_again_after_a_migration
    async def start_attempt(self, job_id: str, allocation_id: int) -> tuple[bool, dict | None]:
        """The job acknowledges a placement and is about to launch it: (launch, the newest
        complete checkpoint to resume from or None). Launch is False when the allocation is not
        this job's live placement (a duplicate or stale signal): nothing is launched."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.fetchrow(q.JOB_FOR_UPDATE, job_id)  # the job before its allocation, as end_attempt
            attempt = await conn.fetchval(q.START_ATTEMPT, allocation_id, job_id)
            if attempt is None:
                row = await conn.fetchrow(q.ALLOCATION, allocation_id)
                # Acknowledged before (the activity ran twice): still the job's to run, from the
                # checkpoint chosen the first time; if a stop was ordered since, the job launches
                # and stops it with its grace, as it would any running attempt.
                if (row is None or row["job_id"] != job_id or row["started_at"] is None
                        or row["state"] not in ("running", "draining")):
                    return False, None
                if row["resumed_from"] is None:
                    return True, None
                return True, dict(await conn.fetchrow(q.CHECKPOINT, job_id, row["resumed_from"]))
            latest = await conn.fetchrow(q.LATEST_COMPLETE_CHECKPOINT, job_id)
            if latest is not None:
                await conn.execute(q.SET_RESUMED_FROM, allocation_id, latest["seq"], latest["work_seconds"] or 0.0)
            await conn.execute(q.MARK_JOB_RUNNING, job_id, attempt)
            how = f"from checkpoint {latest['seq']}" if latest is not None else "from the start"
            await conn.execute(q.AUDIT, None, job_id, "started", f"attempt {attempt} launched {how}",
                               json.dumps({"allocation_id": allocation_id,
                                           "resumed_from": latest["seq"] if latest else None}))
            return True, dict(latest) if latest is not None else None

    async def request_of(self, job_id: str) -> JobRequest | None:
        row = await self.pool.fetchrow(q.JOB, job_id)
        return None if row is None else JobRequest.model_validate(rows.json_value(row["request"]))

    async def allocation_on_machine(self, job_id: str, allocation_id: int, machine_id: str) -> bool:
        """Whether the job's allocation holds a GPU of the machine: what its agent may report for."""
        return bool(await self.pool.fetchval(q.ALLOCATION_ON_MACHINE, allocation_id, job_id, machine_id))

    async def checkpoint_phase(self, allocation_id: int) -> float | None:
        row = await self.pool.fetchrow(q.ALLOCATION, allocation_id)
        return None if row is None else row["checkpoint_phase"]

    async def record_restart(self, job_id: str, allocation_id: int, seconds: float) -> bool:
        """Keep how long a resumed attempt took from its launch to its state restored; the
        scheduler learns restart times from these. False: not a resumed attempt of this job,
        or already recorded."""
        done = await self.pool.execute(q.RECORD_RESTART, job_id, allocation_id, seconds)
        return done.endswith(" 1")

    # --- checkpoints ------------------------------------------------------------------------

    @_again_after_a_migration
    async def commit_checkpoint(self, job_id: str, allocation_id: int, report: CheckpointReport,
                                refusal: str | None) -> tuple[CheckpointAck, list[tuple[int, str]]]:
        """Record a reported checkpoint: complete only if its bytes checked out (``refusal`` is
        None) and ``allocation_id`` is the job's current allocation, running or draining (the
        fence against zombie writers). Returns the answer and the superseded checkpoints whose
        bytes may now be deleted."""
        async with self.pool.acquire() as conn, conn.transaction():
            # The job's row before its allocation's, in the order an attempt's end takes them
            # (end_attempt): taken the other way round, a commit and an end at once deadlocked
            # (bench/chaos.py: the API answered the checkpoint's report 500, with a traceback).
            await conn.fetchrow(q.JOB_FOR_UPDATE, job_id)
            alloc = await conn.fetchrow(q.ALLOCATION_FOR_FENCE, allocation_id)
            # The fence's word comes first: a zombie writer is told it is one, whatever became of
            # its bytes (superseded checkpoints' clean-up may have deleted them meanwhile).
            fence = None
            if alloc is None or alloc["job_id"] != job_id:
                fence = f"allocation {allocation_id} is not job {job_id}'s"
            elif alloc["state"] not in ("running", "draining"):
                fence = (f"allocation {allocation_id} is no longer the job's current one "
                         f"({alloc['state']}): a zombie writer's checkpoint is never committed")
            refusal = fence or refusal
            if refusal is None:
                # Below the two kept, nothing is written any more (a writer's numbers only grow):
                # such a report is late (its object may be gone with the clean-up since), and
                # committed, it made a complete checkpoint of bytes that are not there.
                kept = [r["seq"] for r in await conn.fetch(q.KEPT_CHECKPOINTS, job_id)]
                if len(kept) == 2 and report.seq < min(kept):
                    refusal = (f"checkpoint {report.seq} of job {job_id} is older than its two newest complete ones "
                               f"({min(kept)} and {max(kept)}): superseded before its report came")
            work = as_of = None
            if refusal is None:
                now = await conn.fetchval(q.NOW)
                started = alloc["started_at"] or now
                # The work the bytes hold is as of when they were written, not when the report
                # arrived (a report sent again for a minute, or committed after a later one);
                # the writer's clock is believed only between the start and now.
                as_of = now if report.written_at is None else min(now, max(started, report.written_at))
                # Less the restart the attempt reported (its checkpoint loaded, no work done).
                work = alloc["progress_at_start"] + max(0.0, as_of - started - (alloc["restart_s"] or 0.0))
            done = await conn.execute(q.INSERT_CHECKPOINT, job_id, report.seq, allocation_id, report.key,
                                      report.size, report.sha256, report.progress, work, refusal is None,
                                      refusal, report.written_at)
            if done != "INSERT 0 1":
                existing = await conn.fetchrow(q.CHECKPOINT, job_id, report.seq)
                same = existing["allocation_id"] == allocation_id and existing["sha256"] == report.sha256
                if same:  # the same report again (the agent retried): the same answer
                    return CheckpointAck(committed=existing["complete"], reason=existing["reason"] or "committed"), []
                # The fence's word says more than that the number is taken; the bytes' check does not
                # (they are another writer's).
                refusal = fence or f"checkpoint {report.seq} of job {job_id} was already reported by another writer"
                await conn.execute(q.AUDIT, None, job_id, "checkpoint_refused", refusal,
                                   json.dumps({"seq": report.seq, "allocation_id": allocation_id}))
                return CheckpointAck(committed=False, reason=refusal), []
            if refusal is not None:
                await conn.execute(q.AUDIT, None, job_id, "checkpoint_refused", refusal,
                                   json.dumps({"seq": report.seq, "allocation_id": allocation_id}))
                return CheckpointAck(committed=False, reason=refusal), []
            await conn.execute(q.RECORD_PROGRESS, job_id, work)
            await conn.execute(q.RECORD_CHECKPOINT_TIME, allocation_id, as_of)
            await conn.execute(q.AUDIT, None, job_id, "checkpoint_committed", f"checkpoint {report.seq}",
                               json.dumps({"seq": report.seq, "size": report.size, "allocation_id": allocation_id}))
            superseded = [(r["seq"], r["key"]) for r in await conn.fetch(q.SUPERSEDED_CHECKPOINTS, job_id)]
            return CheckpointAck(committed=True, reason="committed"), superseded

    async def kept_checkpoints(self, job_id: str) -> list[int]:
        """The two newest complete checkpoints, which garbage collection keeps (fewer if fewer)."""
        return [r["seq"] for r in await self.pool.fetch(q.KEPT_CHECKPOINTS, job_id)]

    async def reported_checkpoints(self, job_id: str) -> set[int]:
        """Every checkpoint number a report named, whatever became of it."""
        return {r["seq"] for r in await self.pool.fetch(q.REPORTED_CHECKPOINTS, job_id)}

    async def complete_checkpoints(self, job_id: str) -> list[int]:
        """Every complete checkpoint whose bytes were not deleted as superseded."""
        return [r["seq"] for r in await self.pool.fetch(q.COMPLETE_CHECKPOINTS, job_id)]

    async def mark_checkpoint_deleted(self, job_id: str, seq: int) -> None:
        await self.pool.execute(q.MARK_CHECKPOINT_DELETED, job_id, seq)

    async def checkpoints(self, job_id: str) -> list[CheckpointView]:
        return [rows.checkpoint_view(r) for r in await self.pool.fetch(q.JOB_CHECKPOINTS, job_id)]

    async def end_attempt(self, job_id: str, allocation_id: int | None, end: EndReason,
                          exit_code: int | None, next_state: JobState, reason: str,
                          machine_id: str | None = None, unusable_checkpoint: int | None = None,
                          failures_in_a_row: int = 0) -> None:
        """Give the attempt's GPUs back and move the job on: to the queue again (``queued``)
        or to a terminal state. Idempotent; ``allocation_id`` None ends whatever the job holds.
        ``machine_id``: the machine whose agent failed the attempt, when known.
        ``unusable_checkpoint``: the checkpoint the attempt resumed from, which its job found
        unusable (gone, corrupted): no longer complete, so the next attempt resumes from the one
        before. ``failures_in_a_row``: the job's infrastructure failures in a row, this one
        included, when it goes back to the queue for one: from the second on it is held back
        (``held_back``)."""
        # The reason carries the job's last log lines: a NUL there (an older agent's tail of a
        # binary log) would make Postgres refuse this call on every retry, the GPUs held.
        reason = reason.replace("\0", "\ufffd")
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.fetchrow(q.JOB_FOR_UPDATE, job_id)
            ids = [allocation_id] if allocation_id is not None else [
                r[0] for r in await conn.fetch(q.LIVE_ALLOCATIONS_OF_JOB, job_id)]
            ended = False
            for alloc in ids:
                if await conn.fetchval(q.END_ALLOCATION, alloc, end.value, exit_code) is not None:
                    ended = True
                    if end in (EndReason.machine_failure, EndReason.not_started):
                        await conn.execute(q.MARK_SILENT, alloc, QUIET_S)
                    if end is EndReason.not_started and machine_id is not None:
                        # Named by the workflow that saw its run not picked up (an allocation
                        # given back for want of its workflow names none: no agent is at fault).
                        await conn.execute(q.MARK_UNPICKED, alloc, machine_id, UNPICKED_COOL_DOWN)
                    await conn.execute(q.RELEASE_HOLDS, alloc)
                    await conn.execute(q.AUDIT, None, job_id, "released", end.value,
                                       json.dumps({"allocation_id": alloc, "exit_code": exit_code}))
                    if unusable_checkpoint is not None:
                        await self._mark_unusable(conn, job_id, alloc, unusable_checkpoint, reason)
            if allocation_id is not None and not ended:
                # Ended before: this is a repeat (a retry, or a call that committed late), and the
                # job has moved on since, perhaps to a new attempt that a requeue would orphan.
                return
            if next_state is JobState.queued:
                preempted = end is EndReason.preempted
                hold = None
                if failures_in_a_row >= 2:
                    policy = rows.policy({"policy": await conn.fetchval(q.POLICY_OF_JOB, job_id) or "{}"})
                    hold = held_back(policy.retry_backoff, failures_in_a_row)
                said = None if not hold else (
                    f"held back after {failures_in_a_row} infrastructure failures in a row: it may be placed "
                    f"again {in_words.duration(hold)} after it was queued (the hold doubles with each failure "
                    "in a row, so that a passing outage does not spend its retries)")
                if await conn.execute(q.REQUEUE_JOB, job_id, reason, preempted, hold or None, said) == "UPDATE 1":
                    await conn.execute(q.AUDIT, None, job_id, "requeued", reason, "{}")
            elif next_state.terminal:
                if await conn.execute(q.FINISH_JOB, job_id, next_state.value, reason, exit_code) == "UPDATE 1":
                    await conn.execute(q.AUDIT, None, job_id, next_state.value, reason,
                                       json.dumps({"exit_code": exit_code}))

    async def resumed_checkpoint(self, job_id: str, allocation_id: int, seq: int) -> CheckpointReport | None:
        """Checkpoint ``seq`` as committed, if it is complete and the allocation resumed from it."""
        row = await self.pool.fetchrow(q.RESUMED_FROM_CHECKPOINT, job_id, allocation_id, seq)
        return None if row is None else CheckpointReport(seq=row["seq"], key=row["key"], size=row["size"],
                                                          sha256=row["sha256"])

    async def earlier_doubt(self, job_id: str, allocation_id: int, seq: int) -> tuple[bool, str | None]:
        """Whether a word on checkpoint ``seq`` was doubted already, and why this allocation's
        was (None: it was not this one's)."""
        doubts = await self.pool.fetch(q.CHECKPOINT_DOUBTS, job_id, seq)
        return bool(doubts), next((d["reason"] for d in doubts if d["allocation_id"] == allocation_id), None)

    async def doubt_unusable(self, job_id: str, allocation_id: int, seq: int, machine_id: str | None,
                             said: str) -> str | None:
        """Doubt a machine's word that checkpoint ``seq`` is unusable, when the checkpoint store
        holds it as committed: that machine may be reading another store (its agent's S3
        endpoint, bucket or credentials unlike the control plane's), and believing it throws
        away good work. The machine gets no work for a cool-down, so the next attempt resumes
        from the same checkpoint elsewhere if it can. Once per checkpoint: the next word on it is
        believed (returns None), from whichever machine, since bytes can rot under metadata that
        still matches and a job on one machine, or a gang, must still fall back. Returns why the
        word was doubted; a repeat of the call for the same allocation answers the same."""
        said = said.replace("\0", "\ufffd")  # the job's own words: Postgres refuses a NUL in text
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.fetchrow(q.JOB_FOR_UPDATE, job_id)
            doubts = await conn.fetch(q.CHECKPOINT_DOUBTS, job_id, seq)
            if doubts:
                return next((d["reason"] for d in doubts if d["allocation_id"] == allocation_id), None)
            machine = machine_id or "its machine"
            if machine_id is not None:
                await conn.execute(q.MARK_UNPICKED, allocation_id, machine_id, UNPICKED_COOL_DOWN)
            why = (f"{machine} could not resume from checkpoint {seq}, which the checkpoint store holds as "
                   "committed (its size and SHA-256): it is kept, and the next attempt resumes from it again, on "
                   "another machine if one is free (should that one fail too, the checkpoint is given up); check "
                   f"the S3 settings (endpoint, bucket, credentials) of {machine} against the control plane's. "
                   f"It said: {said}")
            await conn.execute(q.AUDIT, None, job_id, "checkpoint_unusable_doubted", why,
                               json.dumps({"seq": seq, "allocation_id": allocation_id, "machine_id": machine_id}))
            return why

    @staticmethod
    async def _mark_unusable(conn, job_id: str, alloc: int, seq: int, reason: str) -> None:
        why = f"unusable when allocation {alloc} resumed from it: {reason}"
        if await conn.execute(q.MARK_CHECKPOINT_UNUSABLE, job_id, alloc, seq, why) != "UPDATE 1":
            return  # not the checkpoint it resumed from, or marked before
        await conn.execute(q.PROGRESS_FROM_CHECKPOINTS, job_id)
        await conn.execute(q.AUDIT, None, job_id, "checkpoint_unusable", why,
                           json.dumps({"seq": seq, "allocation_id": alloc}))

    # --- the scheduling cycle ---------------------------------------------------------------

    async def plan_cycle(self, cluster: str, cycle_seq: int, planner: Planner) -> CycleOutcome:
        """One cycle in one transaction: lock the cluster's cycle counter, read a consistent
        snapshot, run ``planner`` (the pure core) on it, commit its decisions, and advance the
        counter. A cycle whose number is not the next one (stale, or repeated after its commit)
        changes nothing and only returns the orders not yet acted on whose re-send is due.
        Raises ``CycleConflict`` when a concurrent change invalidates what it read."""
        try:
            # The collector off from the read to the commit (scheduler/gc_policy.py): what the
            # cycle's allocations owe it is collected once its decisions are committed, as this
            # block exits after the transaction's.
            with ExitStack() as collector:
                async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
                    lock = await conn.fetchrow(q.LOCK_CLUSTER, cluster)
                    if lock is None:
                        raise StoreError(f"unknown cluster '{cluster}'")
                    now = await conn.fetchval(q.NOW)
                    if lock["cycle_seq"] != cycle_seq - 1:
                        return await self._resend(conn, cluster, lock, now, committed=False)
                    # Only once the lock is held: waiting for it lasts as long as another
                    # process's transaction.
                    collector.enter_context(no_collections())
                    snapshot = await self._snapshot(conn, cluster, lock, now)
                    result = planner(snapshot)
                    result = await self._commit_refusing_double_booking(conn, cluster, cycle_seq, snapshot, result)
                    outcome = await self._resend(conn, cluster, lock, now, committed=True, seq=cycle_seq)
                    outcome.next_wake_in = None if result.next_wake is None else max(0.0, result.next_wake - now)
                    return outcome
        except (asyncpg.SerializationError, asyncpg.DeadlockDetectedError) as e:
            raise CycleConflict(str(e)) from e

    async def _commit_refusing_double_booking(self, conn, cluster: str, seq: int, snapshot: Snapshot,
                                              result: CycleResult) -> CycleResult:
        """Commit the cycle; if the database refuses a placement onto a GPU still held, commit
        it without the placements onto held GPUs (or, should those collide with each other,
        without any). Retrying would plan the same again, and no cycle of the cluster would ever
        commit. Returns what was committed."""
        try:
            return await self._commit_in_savepoint(conn, cluster, seq, snapshot, result)
        except asyncpg.ExclusionViolationError as e:
            held = {(r["machine_id"], r["idx"]) for r in await conn.fetch(q.HELD_GPUS_OF_CLUSTER, cluster)}
            fewer = result.model_copy(update={"placements": tuple(
                p for p in result.placements if held.isdisjoint(p.gpus))})
            log.error("cycle %d of %s: the database refused a placement onto a GPU still held (%s); "
                      "committing it without the %d onto held GPUs", seq, cluster, e,
                      len(result.placements) - len(fewer.placements))
        try:
            return await self._commit_in_savepoint(conn, cluster, seq, snapshot, fewer)
        except asyncpg.ExclusionViolationError as e:
            log.error("cycle %d of %s: its placements collide (%s); committing it without any", seq, cluster, e)
        none = result.model_copy(update={"placements": ()})
        await self._commit(conn, cluster, seq, snapshot, none)
        return none

    async def _commit_in_savepoint(self, conn, cluster: str, seq: int, snapshot: Snapshot,
                                   result: CycleResult) -> CycleResult:
        async with conn.transaction():
            await self._commit(conn, cluster, seq, snapshot, result)
        return result

    async def snapshot(self, cluster: str) -> Snapshot:
        """A read-only snapshot (for previews: a queue position and ETA right after submit)."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            lock = await conn.fetchrow(q.CLUSTER, cluster)
            if lock is None:
                raise StoreError(f"unknown cluster '{cluster}'")
            return await self._snapshot(conn, cluster, lock, await conn.fetchval(q.NOW))

    async def _snapshot(self, conn, cluster: str, lock, now: float) -> Snapshot:
        config = rows.policy(lock, await conn.fetchval(q.LEARNED_RESTART, cluster))
        return rows.snapshot(
            cluster=cluster,
            now=now,
            lock=lock,
            config=config,
            machines=await conn.fetch(q.SNAPSHOT_MACHINES, cluster, lock["machine_timeout"], LISTEN_GAP),
            running=await conn.fetch(q.SNAPSHOT_RUNNING, cluster),
            queue=await conn.fetch(q.SNAPSHOT_QUEUE, cluster, now),
            quotas=await conn.fetch(q.SNAPSHOT_QUOTAS),
            submissions=await conn.fetch(q.SNAPSHOT_SUBMISSIONS, cluster,
                                         now - config.forecast_window, now),
            reuse=self.reuse.setdefault(cluster, rows.Reuse()),
        )

    async def _commit(self, conn, cluster: str, seq: int, snapshot: Snapshot, result: CycleResult) -> None:
        now = snapshot.now
        queued = {j.spec.job_id: j for j in snapshot.queue}
        events: list[tuple[str, str, str, str]] = []
        # Stops first: a placement taken back frees its GPUs before any new hold is written.
        # A preemption makes room for another job; a requeue leaves GPUs that can no longer be
        # used (a sick GPU: with grace to checkpoint; a machine gone: none), and is no preemption.
        orders = [(v.job_id, v.grace_period, v.reason, v.for_job, EndReason.preempted) for v in result.preemptions]
        orders += [(r.job_id, snapshot.config.grace_period if r.graceful else 0.0, r.reason, None,
                    EndReason.machine_failure) for r in result.requeues]
        for job_id, grace, reason, for_job, end in orders:
            # The job's row before its allocation's, as an attempt's start and end take them:
            # the other way round, a cycle taking a placement back as its attempt ended deadlocked.
            await conn.fetchrow(q.JOB_FOR_UPDATE, job_id)
            live = await conn.fetchrow(q.LIVE_ALLOCATIONS_OF_JOB, job_id)
            if live is None:
                continue
            alloc = live["id"]
            if live["state"] == "placed":
                # Not taken up yet, so nothing runs there to stop: a stop order would wait for
                # an acknowledgement that can no longer launch anything. Its GPUs come back now.
                await conn.fetchval(q.END_ALLOCATION, alloc, end.value, None)
                await conn.execute(q.RELEASE_HOLDS, alloc)
                await conn.execute(q.UNPLACE_JOB, job_id, f"placement taken back before it started: {reason}")
                events.append((job_id, "unplaced", reason, json.dumps({"allocation_id": alloc, "for_job": for_job})))
                continue
            ordered = await conn.execute(q.ORDER_PREEMPTION, alloc, now + grace, now, reason, for_job, end.value)
            if ordered == "UPDATE 1":  # not one draining already (its machine lost in its grace, each cycle)
                events.append((job_id, "preempt_ordered", reason,
                               json.dumps({"allocation_id": alloc, "for_job": for_job})))
        for p in result.placements:
            job = queued[p.job_id]
            attempt = await conn.fetchval(q.NEXT_ATTEMPT, p.job_id)
            paths = [f"{m}/{i}" for m, i in p.gpus]
            alloc = await conn.fetchval(q.INSERT_ALLOCATION, p.job_id, cluster, attempt, paths, seq,
                                        p.checkpoint_phase, job.progress, now, p.reason)
            await conn.executemany(q.INSERT_HOLD, [(alloc, m, i) for m, i in p.gpus])
            await conn.execute(q.MARK_JOB_PLACED, p.job_id, now)
            events.append((p.job_id, "placed", p.reason, json.dumps({"allocation_id": alloc, "gpus": paths})))
        pend = result.pending
        await conn.execute(q.WRITE_PENDING, [p.job_id for p in pend], [p.position for p in pend],
                           [p.estimated_start for p in pend], [p.misses_deadline for p in pend],
                           [p.reason for p in pend])
        if events:
            job_ids, kinds, reasons, data = zip(*events)
            await conn.execute(q.AUDIT_MANY, now, cluster, list(job_ids), list(kinds), list(reasons), list(data))
        earmarks = json.dumps([e.model_dump(mode="json") for e in result.earmarks])
        await conn.execute(q.FINISH_CYCLE, cluster, seq, earmarks, now)

    async def _resend(self, conn, cluster: str, lock, now: float, committed: bool,
                      seq: int | None = None) -> CycleOutcome:
        # This cycle's own orders (made at ``now``) and the older ones still not acted on; those
        # of the last few seconds are left alone, as their first signal may be on its way.
        def due(at: float, row) -> bool:
            if committed and at == now:
                return True
            if row["order_sent_at"] is None:
                return at <= now - RESEND_AFTER
            wait = min(RESEND_AT_MOST, RESEND_AFTER * 2 ** max(0, row["orders_sent"] - 1))
            return row["order_sent_at"] <= now - wait

        placed = [r for r in await conn.fetch(q.UNACKED_PLACEMENTS, cluster, now) if due(r["placed_at"], r)]
        draining = [r for r in await conn.fetch(q.UNACKED_PREEMPTIONS, cluster, now)
                    if due(r["preempt_ordered_at"], r)]
        grace = rows.policy(lock).grace_period
        stops = [rows.preempt_order(r, now) for r in sorted(draining, key=lambda r: r["id"])]
        starts = [rows.placement_order(r, grace) for r in sorted(placed, key=lambda r: r["id"])]
        # Stops first (their victims' grace is running), then placements, oldest first; at least
        # one order, so that a batch always moves.
        orders = [*stops, *starts]
        fit, size = 0, 0
        while fit < len(orders):
            size += len(orders[fit].model_dump_json())
            if fit and size > ORDERS_BYTES_MAX:
                log.warning("cycle of %s: %d order(s) left for the next cycles (%d bytes at most in one answer)",
                            cluster, len(orders) - fit, ORDERS_BYTES_MAX)
                break
            fit += 1
        if fit:
            await conn.execute(q.RECORD_ORDERS_SENT, [o.signal.allocation_id for o in orders[:fit]], now)
        return CycleOutcome(
            cycle_seq=seq if committed else lock["cycle_seq"],
            committed=committed,
            placements=starts[:max(0, fit - len(stops))],
            preemptions=stops[:fit],
        )


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=_json_text, decoder=json.loads, schema="pg_catalog")


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)

