-- How long each resumed attempt took from its launch to its state restored, as jobkit reports it
-- (restored.json, forwarded by the agent). The scheduler learns from the latest of them how long
-- a resumed job takes to start again (PolicyConfig.expected_restart_s, unless a cluster sets it).
ALTER TABLE allocations ADD COLUMN restart_s double precision CHECK (restart_s >= 0);
CREATE INDEX allocations_restart_times ON allocations (cluster, id DESC) WHERE restart_s IS NOT NULL;
