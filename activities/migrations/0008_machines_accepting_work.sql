-- Whether the machine's agent says it takes work: false while it starts (its worker not yet
-- polling), from the moment it is told to shut down, and while it cannot reach Temporal. Its
-- heartbeats alone do not say that it picks attempts up: a shutting-down agent heartbeats
-- through its jobs' grace, and every job placed there meanwhile failed to be picked up, was
-- placed there again, and spent its infrastructure failures.
ALTER TABLE machines ADD COLUMN accepting_work boolean NOT NULL DEFAULT true;
-- Until when the machine takes no new work because an attempt placed there was not picked up
-- although its agent heartbeated: an agent that reaches the API but whose worker does not poll
-- (another task queue, a broken connection to Temporal) would otherwise take job after job.
ALTER TABLE machines ADD COLUMN unpicked_until double precision;
