-- Whether the control plane was hearing heartbeats. A machine's silence is evidence that it is
-- gone only while somebody listened: after the API (or this database) was down for a while, the
-- machines it could not hear are not taken for dead, or one outage would requeue every job of
-- the fleet. One row, refreshed every second by every API process.
CREATE TABLE listening (
    one       boolean PRIMARY KEY DEFAULT true CHECK (one),
    at        double precision NOT NULL,   -- the latest refresh
    since     double precision NOT NULL,   -- refreshed without a break since then
    deaf_from double precision             -- the last refresh before that break (NULL: none)
);
