-- Why the cycle placed an attempt where it did ("4 GPU(s) free: ...", "backfilled: ..."): sent
-- with the placement, so that the job's history in Temporal says it, as it says why a job was
-- preempted.
ALTER TABLE allocations ADD COLUMN placed_reason text;
