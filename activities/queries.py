"""Every SQL statement gpusched runs, by name. ``store.py`` is the only caller.

Times are epoch seconds from the database clock (``NOW_EPOCH``), so agents, workers and the
scheduler share one clock whatever their hosts' clocks say.
"""

NOW_EPOCH = "extract(epoch from clock_timestamp())::double precision"

# --- migrations ---------------------------------------------------------------------------------

CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""
# Two processes migrating at once (two `dev up`s, a worker and a test) take turns.
LOCK_MIGRATIONS = "SELECT pg_advisory_xact_lock(7723001)"
MIGRATION_LOCK_WAIT = "SET LOCAL lock_timeout = {ms}"  # milliseconds; SET takes no parameters
APPLIED_MIGRATIONS = "SELECT version FROM schema_migrations"
RECORD_MIGRATION = "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)"

NOW = f"SELECT {NOW_EPOCH}"

# --- fleet --------------------------------------------------------------------------------------

UPSERT_CLUSTER = "INSERT INTO clusters (name) VALUES ($1) ON CONFLICT (name) DO NOTHING"
UPSERT_MACHINE = """
INSERT INTO machines (id, cluster, block, rack, gpu_type, gpu_memory_gb, partition)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (id) DO UPDATE SET gpu_type = EXCLUDED.gpu_type,
    gpu_memory_gb = EXCLUDED.gpu_memory_gb, partition = EXCLUDED.partition"""
# A machine joining by its agent's first heartbeat: one that a fleet file declared meanwhile (its
# transaction not yet committed when the heartbeat looked) keeps what the file said.
JOIN_MACHINE = """
INSERT INTO machines (id, cluster, block, rack, gpu_type, gpu_memory_gb, partition)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (id) DO NOTHING"""
# A machine declared by the fleet file (`gpusched fleet apply`): a new one joins as the file says;
# one already known (its agent reported its GPUs, type and memory) takes only its partition.
# Answers whether it was new, by the write itself (xmax 0: inserted), and the partition it had
# (NULL where the statement's snapshot could not see it: a heartbeat's join not yet committed,
# which the insert waited for and then updated; `before` alone took such a machine for new).
DECLARE_MACHINE = """
WITH before AS (SELECT partition FROM machines WHERE id = $1)
INSERT INTO machines (id, cluster, block, rack, gpu_type, gpu_memory_gb, partition)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (id) DO UPDATE SET partition = EXCLUDED.partition
RETURNING xmax = 0 AS inserted, (SELECT partition FROM before) AS before"""
MACHINE_IDS = "SELECT id FROM machines WHERE cluster = $1 ORDER BY id"
UPSERT_GPU = """
INSERT INTO gpus (machine_id, idx) VALUES ($1, $2) ON CONFLICT (machine_id, idx) DO NOTHING"""
MACHINE_EXISTS = "SELECT 1 FROM machines WHERE id = $1"
MACHINE_GPU_TYPE = "SELECT gpu_type FROM machines WHERE id = $1"  # NULL: no such machine


def allocations_on_sql(machine: str) -> str:
    """How many allocations hold a GPU of `machine` (an SQL expression for its id) now."""
    return (f"(SELECT count(DISTINCT h.allocation_id) FROM gpu_holds h "
            f"WHERE h.machine_id = {machine} AND upper_inf(h.held))")


# An operator's cordon or drain (migration 0015), after the cycles in flight (ORDER_AFTER_CYCLES):
# once it returns, no cycle places there. NULL: no such machine.
SET_CORDON = f"""
UPDATE machines SET cordon = $2, cordon_reason = $3 WHERE id = $1
RETURNING {allocations_on_sql("machines.id")} AS allocations"""
# A machine that joined when none of its GPUs could be named takes the type its agent reports later.
NAME_UNKNOWN_MACHINE = """
UPDATE machines SET gpu_type = $2, gpu_memory_gb = coalesce($3, gpu_memory_gb) WHERE id = $1 AND gpu_type = 'unknown'"""
# An API process says it hears heartbeats. A gap of more than $1 seconds since the last refresh
# (every API process down, or this database) starts a new stretch of hearing.
LISTENED = f"""
INSERT INTO listening (at, since) SELECT t, t FROM (SELECT {NOW_EPOCH} AS t) AS now
ON CONFLICT (one) DO UPDATE SET
    since = CASE WHEN listening.at < excluded.at - $1 THEN excluded.at ELSE listening.since END,
    deaf_from = CASE WHEN listening.at < excluded.at - $1 THEN listening.at ELSE listening.deaf_from END,
    at = greatest(listening.at, excluded.at)"""
# Whether machine `m` counts as reachable, its cluster's timeout being `timeout`: heard within
# the timeout; or, where the control plane was deaf, it was reachable when the break became
# plain (`gap` after the last refresh: until then the first rule judged it) and, hearing again,
# has been silent less than a timeout since. Without a `listening` row (no API has run: the
# store's own tests) only the first holds.
def reachable_sql(timeout: str, gap: str) -> str:
    return f"""(coalesce(m.last_heartbeat >= {NOW_EPOCH} - {timeout}, false) OR coalesce((
        SELECT CASE WHEN l.at < {NOW_EPOCH} - {gap} THEN m.last_heartbeat >= l.at + {gap} - {timeout}
                    ELSE {NOW_EPOCH} - l.since < {timeout}
                         AND m.last_heartbeat >= coalesce(l.deaf_from + {gap}, l.since) - {timeout} END
        FROM listening l), false))"""


# A machine owes an answer from its agent while its latest heartbeat is older than the latest
# attempt that ended there for want of it.
TAKES_WORK = f"""(m.accepting_work AND coalesce(m.unpicked_until <= {NOW_EPOCH}, true)
    AND (m.silent_since IS NULL OR coalesce(m.last_heartbeat > m.silent_since, false))
    AND m.cordon IS NULL)"""
# The machines' rows are taken in id order, as `fleet apply` takes them (code point order, as
# Python sorts): in the order of a plan, an allocation across m9 and m10 deadlocked with a file
# that lists m10 first.
MARK_SILENT = f"""
UPDATE machines SET silent_since = {NOW_EPOCH}
WHERE id IN (SELECT id FROM machines
             WHERE id IN (SELECT machine_id FROM gpu_holds WHERE allocation_id = $1)
             ORDER BY id COLLATE "C" FOR NO KEY UPDATE)
  AND coalesce(last_heartbeat < {NOW_EPOCH} - $2, true)"""

# How long each machine has been silent (NULL: never heard): whether its agent lives while the
# server heard nothing of a job's watch there.
SILENT_FOR = f"""
SELECT id, {NOW_EPOCH} - last_heartbeat AS silent_for FROM machines WHERE id = ANY($1::text[])"""

# The same with the control plane's hearing: for how long nobody has said it hears (NULL: no API
# ever ran) and how long it has heard without a break.
HEARING = f"""
SELECT m.id, {NOW_EPOCH} - m.last_heartbeat AS silent_for,
       {NOW_EPOCH} - l.at AS unsaid_for, {NOW_EPOCH} - l.since AS listened_for
FROM machines m LEFT JOIN listening l ON true WHERE m.id = ANY($1::text[])"""

# The machine of the allocation whose agent did not pick its attempt up. One whose agent said
# it takes no work (shutting down, Temporal unreachable) is not suspected of a worker that polls
# in vain: that explains it, it is given no work until it says otherwise, and a 5-minute
# cool-down would keep a job off its machine long after a routine agent restart.
MARK_UNPICKED = f"""
UPDATE machines SET unpicked_until = {NOW_EPOCH} + $3
WHERE id = $2 AND accepting_work AND id IN (SELECT machine_id FROM gpu_holds WHERE allocation_id = $1)"""

RECORD_HEARTBEAT = f"""
UPDATE machines SET last_heartbeat = {NOW_EPOCH}, agent_pid = $2, accepting_work = $3 WHERE id = $1"""
# Only a change is written: every heartbeat of every machine reports every GPU, nearly always the
# same (a rewrite of each row each time is most of a fleet's write load, and its dead rows).
SET_GPU_HEALTH = """
UPDATE gpus SET healthy = $3, faults = $4
WHERE machine_id = $1 AND idx = $2 AND (healthy IS DISTINCT FROM $3 OR faults IS DISTINCT FROM $4)"""
# A known machine may come back with more GPUs (a repaired one) or fewer (one its driver lost):
# new ones join; ones it no longer reports stay (holds refer to them) but are unusable.
ADD_REPORTED_GPUS = """
INSERT INTO gpus (machine_id, idx) SELECT $1, unnest($2::int[]) ON CONFLICT (machine_id, idx) DO NOTHING"""
MARK_UNREPORTED_GPUS = """
UPDATE gpus SET healthy = false, faults = ARRAY['missing']
WHERE machine_id = $1 AND NOT (idx = ANY($2::int[])) AND (healthy OR faults <> ARRAY['missing'])"""
LIVE_ALLOCATIONS_OF_CLUSTER = """
SELECT id, job_id, state FROM allocations WHERE cluster = $1 AND state <> 'ended' ORDER BY id"""
QUEUED_JOBS_OF_CLUSTER = """
SELECT id FROM jobs WHERE cluster = $1 AND state = 'queued' ORDER BY id"""
HELD_GPUS_OF_CLUSTER = """
SELECT h.machine_id, h.idx FROM gpu_holds h JOIN allocations a ON a.id = h.allocation_id
WHERE a.cluster = $1 AND a.state <> 'ended' AND upper_inf(h.held)"""  # the live allocations' index, not all history
LIVE_ALLOCATIONS_ON_MACHINE = """
SELECT DISTINCT h.allocation_id FROM gpu_holds h
WHERE h.machine_id = $1 AND upper_inf(h.held)"""
SET_CLUSTER_SETTINGS = """
UPDATE clusters SET policy = coalesce($2, policy), machine_timeout = coalesce($3, machine_timeout)
WHERE name = $1"""
CLUSTER_POLICY_FOR_UPDATE = "SELECT policy FROM clusters WHERE name = $1 FOR UPDATE"
LIST_CLUSTERS = "SELECT name, policy, machine_timeout, cycle_seq FROM clusters ORDER BY name"
CLUSTER_CAPACITY = """
SELECT m.cluster, m.block, m.id, m.gpu_type, m.gpu_memory_gb, m.partition, count(g.idx) AS gpus
FROM machines m JOIN gpus g ON g.machine_id = m.id
GROUP BY m.cluster, m.block, m.id ORDER BY m.cluster, m.id"""
LIST_MACHINES = f"""
SELECT m.id, m.cluster, m.block, m.rack, m.gpu_type, m.gpu_memory_gb, m.partition,
       m.last_heartbeat, m.agent_pid, {NOW_EPOCH} - m.last_heartbeat AS silent_for,
       c.machine_timeout, {reachable_sql("c.machine_timeout", "$2")} AS reachable,
       {TAKES_WORK} AS takes_work, m.cordon, m.cordon_reason, {allocations_on_sql("m.id")} AS allocations,
       array(SELECT DISTINCT a.job_id FROM gpu_holds h JOIN allocations a ON a.id = h.allocation_id
             WHERE h.machine_id = m.id AND upper_inf(h.held) ORDER BY a.job_id) AS job_ids,
       array_agg(g.idx ORDER BY g.idx) AS gpus,
       array_agg(g.idx ORDER BY g.idx) FILTER (WHERE NOT g.healthy) AS unhealthy
FROM machines m JOIN clusters c ON c.name = m.cluster JOIN gpus g ON g.machine_id = m.id
WHERE ($1::text IS NULL OR m.cluster = $1)
GROUP BY m.id, c.machine_timeout ORDER BY m.id"""

# --- quotas -------------------------------------------------------------------------------------

# Before a change that cycles read but never write (a quota, a machine's partition): every
# cluster's row locked in name order (as a cycle locks its own first) and touched. A cycle in
# flight commits first, under what it read; one that took its snapshot before the change commits
# and locks its row after finds the row changed, fails (a serialization failure, a conflict the
# planning activity reads again after) and plans with the change.
ORDER_AFTER_CYCLES = """
UPDATE clusters SET cycle_seq = cycle_seq
WHERE name IN (SELECT name FROM clusters ORDER BY name FOR NO KEY UPDATE)"""
SET_QUOTA = """
INSERT INTO quotas (team, guaranteed, max_gpus, queue_cap) VALUES ($1, $2, $3, $4)
ON CONFLICT (team) DO UPDATE SET guaranteed = EXCLUDED.guaranteed, max_gpus = EXCLUDED.max_gpus,
    queue_cap = EXCLUDED.queue_cap, updated_at = now()"""
LIST_QUOTAS = "SELECT team, guaranteed, max_gpus, queue_cap FROM quotas ORDER BY team"

# --- machine tokens (migration 0014) ------------------------------------------------------------

TOKEN_GENERATIONS = "SELECT machine_id, generation FROM machine_tokens"
TOKEN_GENERATION = "SELECT coalesce((SELECT generation FROM machine_tokens WHERE machine_id = $1), 0)"
RENEW_MACHINE_TOKEN = """
INSERT INTO machine_tokens (machine_id, generation) VALUES ($1, 1)
ON CONFLICT (machine_id) DO UPDATE SET generation = machine_tokens.generation + 1, renewed_at = clock_timestamp()
RETURNING generation
"""
# The team's own quota, else the "*" default every team not named has (as the scheduler reads them).
QUOTA = """
SELECT guaranteed, max_gpus, queue_cap FROM quotas WHERE team = $1 OR team = '*'
ORDER BY team = $1 DESC LIMIT 1"""
# Serialises a team's admissions (a team of the default quota has no row of its own to lock),
# and so two admissions of one job (an activity retried while its first try still runs). The
# two-key form: its keys never meet the one-key migrations lock's.
LOCK_TEAM_ADMISSIONS = "SELECT pg_advisory_xact_lock(7723002, hashtext($1))"
TEAM_WAITING_JOBS = """
SELECT count(*) FROM jobs WHERE team = $1 AND state IN ('queued', 'placed')"""

# --- jobs ---------------------------------------------------------------------------------------

INSERT_JOB = f"""
INSERT INTO jobs (id, team, cluster, request, priority, num_gpus, state, submit_time,
                  queued_since, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, 'queued', $7, $7, {NOW_EPOCH})
ON CONFLICT (id) DO NOTHING"""
JOB = "SELECT * FROM jobs WHERE id = $1"
# One change of a job at a time. NO KEY UPDATE, not UPDATE: the cycle's commit, holding the
# allocations it orders stopped or resends, has Postgres check the job key of the allocations it
# writes under KEY SHARE, which FOR UPDATE blocks: an attempt's end that held its job and waited
# for one of those allocations deadlocked with it (bench/chaos.py saw three in a row, each costing
# a second and a retry).
JOB_FOR_UPDATE = "SELECT id FROM jobs WHERE id = $1 FOR NO KEY UPDATE"  # a lock: its columns are not read


def _newest_jobs(where: str) -> str:
    """The newest $1 jobs that match, oldest first: read backwards along an index of submit times
    (one query per filter, so that each plan can use one; `$2 IS NULL OR team = $2` could not),
    not the whole table sorted, which grows by every job ever submitted."""
    return f"""
SELECT * FROM (SELECT * FROM jobs {where} ORDER BY submit_time DESC, id DESC LIMIT $1) newest
ORDER BY submit_time, id"""


# By (a team given, a state given); the values follow the limit, in that order.
LIST_JOBS = {
    (False, False): _newest_jobs(""),
    (True, False): _newest_jobs("WHERE team = $2"),
    (False, True): _newest_jobs("WHERE state = $2"),
    (True, True): _newest_jobs("WHERE team = $2 AND state = $3"),
}
ATTEMPTS = """
SELECT job_id, id, attempt, gpus, started_at, placed_at, ended_at, end_reason, exit_code, state, resumed_from,
       restart_s, preempt_reason, draining_until
FROM allocations WHERE job_id = ANY($1::text[]) ORDER BY job_id, attempt"""
SET_PRIORITY = f"""
UPDATE jobs SET priority = $2, request = jsonb_set(request, '{{priority}}', to_jsonb($2::text)),
    updated_at = {NOW_EPOCH}
WHERE id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled')"""
# Only while the attempt it describes still drains: a late or repeated call must not hide a job
# that has since gone back to the queue (the snapshot reads only queued jobs).
MARK_JOB_CHECKPOINTING = f"""
UPDATE jobs SET state = 'checkpointing', updated_at = {NOW_EPOCH} WHERE id = $1 AND state = 'running'
  AND EXISTS (SELECT 1 FROM allocations WHERE job_id = $1 AND state = 'draining')"""
FINISH_JOB = f"""
UPDATE jobs SET state = $2, reason = $3, exit_code = $4, position = NULL, estimated_start = NULL,
    pending_reason = NULL, updated_at = {NOW_EPOCH}
WHERE id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled')"""
# $4: seconds the job is held back before it may be placed again (NULL: none), said in $5; the
# end of its hold is the earliest it may start, so that is its estimated start until a cycle has it.
REQUEUE_JOB = f"""
UPDATE jobs SET state = 'queued', queued_since = {NOW_EPOCH}, reason = $2,
    preemptions = CASE WHEN $3 THEN preemptions || {NOW_EPOCH} ELSE preemptions END,
    held_until = {NOW_EPOCH} + $4, position = NULL, estimated_start = {NOW_EPOCH} + $4, pending_reason = $5,
    updated_at = {NOW_EPOCH}
WHERE id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled')"""
# The policy of the cluster a job runs in: how long a requeue holds it back.
POLICY_OF_JOB = "SELECT c.policy FROM jobs j JOIN clusters c ON c.name = j.cluster WHERE j.id = $1"

# --- allocations --------------------------------------------------------------------------------

ALLOCATION = "SELECT * FROM allocations WHERE id = $1"
# Whether a job's allocation holds a GPU of a machine (a GPU's path is its machine's, then its index).
ALLOCATION_ON_MACHINE = """
SELECT EXISTS (SELECT 1 FROM allocations AS a, unnest(a.gpus) AS g
               WHERE a.id = $1 AND a.job_id = $2 AND regexp_replace(g, '/[^/]*$', '') = $3)"""
LIVE_ALLOCATIONS_OF_JOB = "SELECT id, state FROM allocations WHERE job_id = $1 AND state <> 'ended'"
START_ATTEMPT = f"""
UPDATE allocations SET state = 'running', started_at = {NOW_EPOCH}, version = version + 1
WHERE id = $1 AND job_id = $2 AND state = 'placed'
RETURNING attempt"""
MARK_JOB_RUNNING = f"""
UPDATE jobs SET state = 'running', attempts = $2, position = NULL, estimated_start = NULL,
    pending_reason = NULL, updated_at = {NOW_EPOCH}
WHERE id = $1 AND state IN ('placed', 'queued')"""
END_ALLOCATION = f"""
UPDATE allocations SET state = 'ended', ended_at = {NOW_EPOCH}, end_reason = $2, exit_code = $3,
    version = version + 1
WHERE id = $1 AND state <> 'ended'
RETURNING job_id"""
# A hold closes at the database's clock, which is after the hold opened (same clock).
RELEASE_HOLDS = """
UPDATE gpu_holds SET held = tstzrange(lower(held), greatest(clock_timestamp(), lower(held) + interval '1 microsecond'))
WHERE allocation_id = $1 AND upper_inf(held)"""

# --- the scheduling cycle -----------------------------------------------------------------------

# Taken first in the cycle's transaction: cycles of one cluster run one at a time, and a cycle
# whose number is not the next one commits nothing. Not FOR UPDATE: that would also hold off the
# key-share lock every insert of a job or machine of the cluster takes on its row.
CLUSTER = "SELECT cycle_seq, earmarks, policy, machine_timeout FROM clusters WHERE name = $1"
LOCK_CLUSTER = CLUSTER + " FOR NO KEY UPDATE"
SNAPSHOT_MACHINES = f"""
SELECT m.id, m.cluster, m.block, m.rack, m.gpu_type, m.gpu_memory_gb, m.partition,
       {reachable_sql("$2", "$3")} AS reachable, {TAKES_WORK} AS takes_work,
       coalesce(m.cordon = 'draining', false) AS drain,
       count(g.idx) AS gpus,
       coalesce(array_agg(g.idx) FILTER (WHERE NOT g.healthy), '{{}}') AS unhealthy
FROM machines m JOIN gpus g ON g.machine_id = m.id
WHERE m.cluster = $1
GROUP BY m.id ORDER BY m.id"""
SNAPSHOT_RUNNING = """
SELECT a.id AS allocation_id, a.job_id, a.gpus, a.placed_at, a.started_at, a.progress_at_start,
       a.checkpoint_phase, a.draining_until, a.preempted_for, a.state, a.last_checkpoint_at,
       j.request, j.submit_time, j.preemptions, j.priority
FROM allocations a JOIN jobs j ON j.id = a.job_id
WHERE a.cluster = $1 AND a.state <> 'ended'
ORDER BY a.id"""
# A job held back after infrastructure failures in a row is not in the queue until then.
SNAPSHOT_QUEUE = """
SELECT id, request, priority, submit_time, queued_since, progress, preemptions
FROM jobs WHERE cluster = $1 AND state = 'queued' AND (held_until IS NULL OR held_until <= $2)
ORDER BY id"""
SNAPSHOT_QUOTAS = "SELECT team, guaranteed, max_gpus, queue_cap FROM quotas"
# The submissions the estimates' forecast of arrivals is made from (scheduler/forecast.py).
SNAPSHOT_SUBMISSIONS = """
SELECT submit_time, priority, num_gpus, (request->>'expected_duration')::double precision AS expected_duration
FROM jobs WHERE cluster = $1 AND submit_time > $2 AND submit_time <= $3"""
NEXT_ATTEMPT = "SELECT coalesce(max(attempt), 0) + 1 FROM allocations WHERE job_id = $1"
INSERT_ALLOCATION = """
INSERT INTO allocations (job_id, cluster, attempt, gpus, state, cycle_seq, checkpoint_phase,
                         progress_at_start, placed_at, placed_reason)
VALUES ($1, $2, $3, $4, 'placed', $5, $6, $7, $8, $9)
RETURNING id"""
# A hold opens at the database's clock, or where the GPU's last hold closed if that is later: a
# clock stepped back (a VM resumed, NTP stepping it) would otherwise open it inside the closed
# one, the constraint would refuse it, and each cycle would commit without its placements until
# the clock caught up. Still refused while the GPU's last hold is open (greatest() skips NULL).
INSERT_HOLD = """
INSERT INTO gpu_holds (allocation_id, machine_id, idx, held)
SELECT $1, $2, $3, tstzrange(greatest(clock_timestamp(), (SELECT max(upper(held)) FROM gpu_holds
                                                         WHERE machine_id = $2 AND idx = $3)), NULL)"""
MARK_JOB_PLACED = """
UPDATE jobs SET state = 'placed', position = NULL, estimated_start = NULL, pending_reason = NULL,
    updated_at = $2
WHERE id = $1 AND state = 'queued'"""
# A placement its job never took up is not preempted but taken back: nothing runs on its GPUs,
# and the job keeps its place in the queue (its queued_since), with no preemption counted.
UNPLACE_JOB = f"""
UPDATE jobs SET state = 'queued', reason = $2, updated_at = {NOW_EPOCH} WHERE id = $1 AND state = 'placed'"""
ORDER_PREEMPTION = """
UPDATE allocations SET state = 'draining', draining_until = $2, preempt_ordered_at = $3,
    preempt_reason = $4, preempted_for = $5, preempt_end = $6, version = version + 1,
    orders_sent = 0, order_sent_at = NULL
WHERE id = $1 AND state IN ('placed', 'running')"""
# A running attempt its job's cancel stops: shown stopping, and its GPUs expected back by the end
# of the grace it is given, as a preempted one's (the cycle displaces nobody for a job leaving).
MARK_STOPPING = f"""
UPDATE allocations SET draining_until = {NOW_EPOCH} + $2, preempt_reason = $3, version = version + 1
WHERE id = $1 AND state IN ('placed', 'running') AND draining_until IS NULL"""
WRITE_PENDING = """
UPDATE jobs SET position = p.position, estimated_start = p.estimated_start,
    misses_deadline = p.misses_deadline, pending_reason = p.reason
FROM unnest($1::text[], $2::int[], $3::double precision[], $4::boolean[], $5::text[])
     AS p(job_id, position, estimated_start, misses_deadline, reason)
WHERE jobs.id = p.job_id AND jobs.state = 'queued'
  -- Only what changed: rewritten unchanged, every queued job's row was written each cycle, and a
  -- job cancelled or bumped while the cycle planned made its commit fail (planned again) though
  -- nothing the cycle wrote of that job was new.
  AND (jobs.position IS DISTINCT FROM p.position OR jobs.estimated_start IS DISTINCT FROM p.estimated_start
       OR jobs.misses_deadline IS DISTINCT FROM p.misses_deadline OR jobs.pending_reason IS DISTINCT FROM p.reason)"""
FINISH_CYCLE = "UPDATE clusters SET cycle_seq = $2, earmarks = $3, last_cycle_at = $4 WHERE name = $1"
# Orders that a job has not acted on yet: sent again (jobs take duplicates idempotently).
UNACKED_PLACEMENTS = """
SELECT a.id, a.job_id, a.attempt, a.gpus, a.checkpoint_phase, a.placed_at, a.orders_sent, a.order_sent_at,
       a.placed_reason
FROM allocations a WHERE a.cluster = $1 AND a.state = 'placed' AND a.placed_at <= $2"""
UNACKED_PREEMPTIONS = """
SELECT a.id, a.job_id, a.draining_until, a.preempt_reason, a.preempt_ordered_at, a.preempt_end,
       a.orders_sent, a.order_sent_at
FROM allocations a WHERE a.cluster = $1 AND a.state = 'draining' AND a.preempt_ordered_at <= $2"""
RECORD_ORDERS_SENT = """
UPDATE allocations SET orders_sent = orders_sent + 1, order_sent_at = $2 WHERE id = ANY($1::bigint[])"""

# --- checkpoints --------------------------------------------------------------------------------

# The fence: the reporting allocation must be the job's current one, and running (or draining:
# a preempted job checkpoints in its grace period).
ALLOCATION_FOR_FENCE = "SELECT * FROM allocations WHERE id = $1 FOR UPDATE"
INSERT_CHECKPOINT = f"""
INSERT INTO checkpoints (job_id, seq, allocation_id, key, size, sha256, progress, work_seconds,
                         complete, reason, written_at, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, {NOW_EPOCH})
ON CONFLICT (job_id, seq) DO UPDATE SET
    allocation_id = EXCLUDED.allocation_id, key = EXCLUDED.key, size = EXCLUDED.size,
    sha256 = EXCLUDED.sha256, progress = EXCLUDED.progress, work_seconds = EXCLUDED.work_seconds,
    complete = EXCLUDED.complete, reason = EXCLUDED.reason, written_at = EXCLUDED.written_at,
    created_at = EXCLUDED.created_at, deleted_at = NULL, unusable_at = NULL
  -- A number written again after its checkpoint was found unusable (its object gone) or
  -- collected (a job that fell back to its start), or whose report was refused (its bytes were
  -- not there, or not the reported ones): the new report's bytes were verified at that key, so
  -- the old row describes bytes that are not there. A refused report leaves the row as it was,
  -- and so does the same report again of a checkpoint since collected (it stays collected).
  WHERE EXCLUDED.complete
    AND (NOT checkpoints.complete OR checkpoints.unusable_at IS NOT NULL
         OR checkpoints.deleted_at IS NOT NULL
            AND (checkpoints.allocation_id, checkpoints.sha256)
                IS DISTINCT FROM (EXCLUDED.allocation_id, EXCLUDED.sha256))"""
CHECKPOINT = "SELECT * FROM checkpoints WHERE job_id = $1 AND seq = $2"
RECORD_PROGRESS = f"""
UPDATE jobs SET progress = greatest(progress, $2), updated_at = {NOW_EPOCH} WHERE id = $1"""
RECORD_CHECKPOINT_TIME = """
UPDATE allocations SET last_checkpoint_at = greatest(last_checkpoint_at, $2) WHERE id = $1"""
# What garbage collection keeps of a job: its two newest complete checkpoints.
KEPT_CHECKPOINTS = """
SELECT seq FROM checkpoints WHERE job_id = $1 AND complete AND deleted_at IS NULL
ORDER BY seq DESC LIMIT 2"""
# Every number a report named (refused, deleted and unusable ones included).
REPORTED_CHECKPOINTS = "SELECT seq FROM checkpoints WHERE job_id = $1"
# What a job that has ended keeps: every complete checkpoint not deleted yet.
COMPLETE_CHECKPOINTS = """
SELECT seq FROM checkpoints WHERE job_id = $1 AND complete AND deleted_at IS NULL ORDER BY seq"""
# Superseded: every complete checkpoint but the two newest, and incomplete ones older than the
# older of those (abandoned or refused writes). Their bytes can go.
SUPERSEDED_CHECKPOINTS = f"""
WITH keep AS ({KEPT_CHECKPOINTS})
SELECT seq, key FROM checkpoints
WHERE job_id = $1 AND deleted_at IS NULL AND seq NOT IN (SELECT seq FROM keep)
  AND seq < (SELECT coalesce(min(seq), 0) FROM keep)
  AND (SELECT count(*) FROM keep) = 2
ORDER BY seq"""
MARK_CHECKPOINT_DELETED = f"""
UPDATE checkpoints SET deleted_at = {NOW_EPOCH} WHERE job_id = $1 AND seq = $2"""
LATEST_COMPLETE_CHECKPOINT = """
SELECT seq, key, sha256, work_seconds FROM checkpoints
WHERE job_id = $1 AND complete AND deleted_at IS NULL ORDER BY seq DESC LIMIT 1"""
JOB_CHECKPOINTS = "SELECT * FROM checkpoints WHERE job_id = $1 ORDER BY seq"
# Only the checkpoint the ending allocation resumed from: the job's word is on that one alone.
MARK_CHECKPOINT_UNUSABLE = f"""
UPDATE checkpoints SET complete = false, unusable_at = {NOW_EPOCH}, reason = $4
WHERE job_id = $1 AND seq = $3 AND complete
  AND seq = (SELECT resumed_from FROM allocations WHERE id = $2 AND job_id = $1)"""
# The complete checkpoint an allocation resumed from, as committed, or nothing.
RESUMED_FROM_CHECKPOINT = """
SELECT c.seq, c.key, c.size, c.sha256 FROM checkpoints c JOIN allocations a ON a.job_id = c.job_id
WHERE c.job_id = $1 AND a.id = $2 AND c.seq = $3 AND a.resumed_from = c.seq AND c.complete"""
# The words that the checkpoint numbered $2 was unusable the control plane doubted: of this
# checkpoint, not of an earlier one of that number (a number written again after its first
# checkpoint was given up).
CHECKPOINT_DOUBTS = """
SELECT (data->>'allocation_id')::bigint AS allocation_id, data->>'machine_id' AS machine_id, reason FROM audit
WHERE job_id = $1 AND event = 'checkpoint_unusable_doubted' AND (data->>'seq')::int = $2
  AND at >= (SELECT created_at FROM checkpoints WHERE job_id = $1 AND seq = $2)"""
# The work the job holds is what its newest complete checkpoint holds (none: nothing).
PROGRESS_FROM_CHECKPOINTS = f"""
UPDATE jobs SET updated_at = {NOW_EPOCH},
    progress = coalesce((SELECT work_seconds FROM ({LATEST_COMPLETE_CHECKPOINT}) latest), 0)
WHERE id = $1"""
SET_RESUMED_FROM = "UPDATE allocations SET resumed_from = $2, progress_at_start = $3 WHERE id = $1"
# Only an attempt that resumed from a checkpoint restarts; the first report counts.
# No longer than the attempt has run: the time comes from the job's own process, and a job that
# said a day would move every estimate of its cluster (the median of the latest 50).
RECORD_RESTART = f"""
UPDATE allocations SET restart_s = GREATEST(0, LEAST($3, {NOW_EPOCH} - started_at))
WHERE id = $2 AND job_id = $1 AND resumed_from IS NOT NULL AND restart_s IS NULL"""
# What a cluster's resumed jobs took to start again lately: the median of the latest 50.
LEARNED_RESTART = """
SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY restart_s) FROM (
    SELECT restart_s FROM allocations WHERE cluster = $1 AND restart_s IS NOT NULL
    ORDER BY id DESC LIMIT 50) latest"""

# --- audit --------------------------------------------------------------------------------------

AUDIT = f"""
INSERT INTO audit (at, cluster, job_id, event, reason, data)
VALUES ({NOW_EPOCH}, $1, $2, $3, $4, $5)"""
AUDIT_MANY = """
INSERT INTO audit (at, cluster, job_id, event, reason, data)
SELECT $1, $2, e.job_id, e.event, e.reason, e.data
FROM unnest($3::text[], $4::text[], $5::text[], $6::jsonb[]) AS e(job_id, event, reason, data)"""
AUDIT_OF_JOB = "SELECT at, cluster, event, reason, data FROM audit WHERE job_id = $1 ORDER BY id"
