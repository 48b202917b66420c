-- The system of record: the fleet, quotas, jobs and their queue fields, allocations and an audit
-- log. Times the scheduler reasons about are epoch seconds (double precision) read from the
-- database clock, so every process shares one clock; the GPU hold ranges are timestamptz so that
-- the exclusion constraint below can compare them.

CREATE EXTENSION IF NOT EXISTS btree_gist;

CREATE TABLE clusters (
    name            text PRIMARY KEY,
    cycle_seq       bigint NOT NULL DEFAULT 0,      -- the last committed scheduling cycle
    last_cycle_at   double precision,
    earmarks        jsonb NOT NULL DEFAULT '[]',    -- promises the last cycle handed to the next
    policy          jsonb NOT NULL DEFAULT '{}',    -- PolicyConfig overrides
    machine_timeout double precision NOT NULL DEFAULT 120  -- silent this long: unreachable
);

CREATE TABLE machines (
    id             text PRIMARY KEY,                -- topology path cluster/block/rack/machine
    cluster        text NOT NULL REFERENCES clusters (name),
    block          text NOT NULL,
    rack           text NOT NULL,
    gpu_type       text NOT NULL,
    gpu_memory_gb  double precision NOT NULL DEFAULT 80,
    partition      text NOT NULL DEFAULT 'training',
    last_heartbeat double precision,                -- NULL: its agent has never reported
    agent_pid      integer
);

CREATE TABLE gpus (
    machine_id text NOT NULL REFERENCES machines (id),
    idx        integer NOT NULL,
    healthy    boolean NOT NULL DEFAULT true,
    faults     text[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (machine_id, idx)
);

CREATE TABLE quotas (
    team       text PRIMARY KEY,
    guaranteed integer NOT NULL CHECK (guaranteed >= 0),
    max_gpus   integer CHECK (max_gpus IS NULL OR max_gpus >= guaranteed),
    queue_cap  integer CHECK (queue_cap IS NULL OR queue_cap >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE jobs (
    id              text PRIMARY KEY,
    team            text NOT NULL,
    cluster         text NOT NULL REFERENCES clusters (name),  -- the scheduler that owns it
    request         jsonb NOT NULL,                  -- workflows.types.JobRequest
    priority        text NOT NULL,
    num_gpus        integer NOT NULL,
    state           text NOT NULL,
    submit_time     double precision NOT NULL,
    queued_since    double precision NOT NULL,
    progress        double precision NOT NULL DEFAULT 0,   -- work saved in the last checkpoint
    preemptions     double precision[] NOT NULL DEFAULT '{}',
    attempts        integer NOT NULL DEFAULT 0,
    exit_code       integer,
    reason          text,
    position        integer,                         -- queue fields, as the last cycle left them
    estimated_start double precision,
    misses_deadline boolean,
    pending_reason  text,
    updated_at      double precision NOT NULL
);
CREATE INDEX jobs_by_cluster_state ON jobs (cluster, state);
CREATE INDEX jobs_by_team_state ON jobs (team, state);

CREATE TABLE allocations (
    id               bigserial PRIMARY KEY,
    job_id           text NOT NULL REFERENCES jobs (id),
    cluster          text NOT NULL,
    attempt          integer NOT NULL,
    gpus             text[] NOT NULL,                -- topology paths, in gang rank order
    state            text NOT NULL CHECK (state IN ('placed', 'running', 'draining', 'ended')),
    version          integer NOT NULL DEFAULT 1,     -- bumped by every change of state
    cycle_seq        bigint NOT NULL,                -- the cycle that made it
    checkpoint_phase double precision,
    progress_at_start double precision NOT NULL DEFAULT 0,
    placed_at        double precision NOT NULL,
    started_at       double precision,               -- the job acknowledged it and launched
    ended_at         double precision,
    draining_until   double precision,               -- preempted: the end of its grace period
    preempt_ordered_at double precision,
    preempt_reason   text,
    preempt_end      text,                           -- how the attempt will be recorded: preempted, machine_failure
    preempted_for    text,
    end_reason       text,
    exit_code        integer,
    UNIQUE (job_id, attempt)
);
-- A job holds at most one allocation at a time.
CREATE UNIQUE INDEX allocations_one_live_per_job ON allocations (job_id) WHERE state <> 'ended';

-- Each GPU an allocation holds, over the time it holds it. The exclusion constraint is the
-- invariant "a GPU is never double-booked", enforced by the database whatever the code above
-- it does: two holds of one GPU may never overlap in time, including one still open.
CREATE TABLE gpu_holds (
    allocation_id bigint NOT NULL REFERENCES allocations (id),
    machine_id    text NOT NULL,
    idx           integer NOT NULL,
    held          tstzrange NOT NULL,
    PRIMARY KEY (allocation_id, machine_id, idx),
    FOREIGN KEY (machine_id, idx) REFERENCES gpus (machine_id, idx),
    CONSTRAINT gpu_never_double_booked EXCLUDE USING gist (machine_id WITH =, idx WITH =, held WITH &&)
);
CREATE INDEX gpu_holds_open_by_machine ON gpu_holds (machine_id) WHERE upper_inf(held);

CREATE TABLE audit (
    id      bigserial PRIMARY KEY,
    at      double precision NOT NULL,
    cluster text,
    job_id  text,
    event   text NOT NULL,       -- submitted, refused, placed, started, preempt_ordered, ended, ...
    reason  text,
    data    jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_by_job ON audit (job_id, id);
