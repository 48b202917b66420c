-- When a job found a committed checkpoint unusable as it resumed from it (its object gone, its
-- bytes not matching their SHA-256): it is no longer complete, so the next attempt resumes from
-- the one before. Its number may be written again (the object was gone): that report, once its
-- bytes check out, replaces it.
ALTER TABLE checkpoints ADD COLUMN unusable_at double precision;
