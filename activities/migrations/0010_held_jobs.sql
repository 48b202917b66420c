-- A job queued again after infrastructure failures in a row is held back before it may be placed
-- again (PolicyConfig.retry_backoff, doubling with each failure): a passing outage of what its
-- attempts need (the checkpoint store, say) would otherwise spend its retries within seconds.
-- The cycle's snapshot leaves a job out of its queue until then.
ALTER TABLE jobs ADD COLUMN held_until double precision;
