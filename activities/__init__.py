"""Everything with I/O: the Postgres store, the plan-cycle activity, S3 checkpoints, node-side work."""
