-- Checkpoints: S3 holds the bytes under write-once, sequence-numbered keys; this table says which
-- of them are complete. Only a complete checkpoint is ever resumed from, and a report becomes
-- complete only if its bytes check out (size, MD5, SHA-256) and it comes from the job's current
-- allocation (the fencing token). Refused reports are kept too, with the reason.

CREATE TABLE checkpoints (
    job_id        text NOT NULL REFERENCES jobs (id),
    seq           integer NOT NULL CHECK (seq >= 1),
    allocation_id bigint NOT NULL,                  -- the allocation that reported it
    key           text NOT NULL,                    -- the object's key in the bucket
    size          bigint NOT NULL,
    sha256        text NOT NULL,
    progress      double precision,                 -- the job's own measure (its step, say)
    work_seconds  double precision,                 -- seconds of running it holds
    complete      boolean NOT NULL,
    reason        text,                             -- why it was refused
    written_at    double precision,                 -- when the job wrote it (its clock)
    created_at    double precision NOT NULL,        -- when it was reported
    deleted_at    double precision,                 -- its bytes were deleted (superseded)
    PRIMARY KEY (job_id, seq)
);

ALTER TABLE allocations ADD COLUMN resumed_from integer;          -- the checkpoint seq it started from
ALTER TABLE allocations ADD COLUMN last_checkpoint_at double precision;
