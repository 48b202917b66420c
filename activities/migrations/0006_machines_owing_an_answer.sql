-- When an attempt on a machine last ended for want of its agent (a missed heartbeat or pickup,
-- a machine failure). Until the agent heartbeats after it, the machine takes no new work; what
-- runs there stays. Without it, a job requeued from a dead machine went straight back to it
-- (empty and, until the machine timeout, still reachable), failed to be picked up, and spent the
-- job's few infrastructure failures on one death.
ALTER TABLE machines ADD COLUMN silent_since double precision;
