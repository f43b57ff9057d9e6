-- sidelock PostgreSQL backend, schema version 3: elections.
--
-- An election is an exclusive lock whose keys have the kind 'election', so
-- that election names never meet lock names. The functions treat every kind
-- but 'semaphore' as a lock already; only the kind check, the NOTIFY payload
-- and the safety net of one exclusive holder per name change. Sidecars of
-- versions 1 and 2 keep working on this schema: they never write the new kind.

ALTER TABLE {s}.keys DROP CONSTRAINT keys_kind_check;
ALTER TABLE {s}.keys ADD CONSTRAINT keys_kind_check
    CHECK (kind IN ('lock', 'semaphore', 'election'));

-- `locks/<name>`, `semaphores/<name>` or `elections/<name>`: the NOTIFY
-- payload and stale key.
CREATE OR REPLACE FUNCTION {s}.key_text(p_kind text, p_name text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE p_kind WHEN 'lock' THEN 'locks/' WHEN 'election' THEN 'elections/'
                         ELSE 'semaphores/' END || p_name $$;

-- The safety net of `leases_one_exclusive`, for elections: one leader per name.
CREATE UNIQUE INDEX leases_one_leader ON {s}.leases (name)
    WHERE kind = 'election' AND mode = 'exclusive';
