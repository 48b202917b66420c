-- The estimates' forecast of arrivals reads each cycle the cluster's submissions of the last day
-- (scheduler/forecast.py).
CREATE INDEX jobs_by_cluster_submit_time ON jobs (cluster, submit_time);
