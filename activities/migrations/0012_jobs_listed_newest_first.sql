-- `gpusched list` (and GET /jobs) shows the newest jobs, of a team or in a state or of all:
-- read backwards along these, not by sorting every job ever submitted. (Built under a lock on
-- writes to jobs: on a table of millions of jobs, migrate in a quiet minute.)
CREATE INDEX jobs_by_submit_time ON jobs (submit_time, id);
CREATE INDEX jobs_by_team_submit_time ON jobs (team, submit_time, id);
CREATE INDEX jobs_by_state_submit_time ON jobs (state, submit_time, id);
