-- A machine's agent token can be renewed alone (`gpusched fleet token MACHINE --renew`): a machine
-- taken over, or retired, is cut off without changing every other machine's token. A machine's
-- token is made from the API's token, its id and its generation here; a machine with no row is at
-- generation 0, whose token is the one made before renewals existed. Not tied to `machines`: a
-- token can be made, and renewed, for a machine before its agent has ever joined.
CREATE TABLE machine_tokens (
    machine_id text PRIMARY KEY,
    generation integer NOT NULL CHECK (generation > 0),
    renewed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
