-- An operator takes a machine out of service (`gpusched fleet cordon` / `fleet drain`): a
-- cordoned machine takes no new work and its jobs run on; a draining one also asks its jobs to
-- checkpoint and move, with their grace. NULL: in service. The reason is the operator's own
-- words, shown wherever the machine is listed. Kept apart from what the agent says
-- (accepting_work): an agent's restart must not put a machine back in service.
ALTER TABLE machines ADD COLUMN cordon text CHECK (cordon IN ('cordoned', 'draining'));
ALTER TABLE machines ADD COLUMN cordon_reason text;
