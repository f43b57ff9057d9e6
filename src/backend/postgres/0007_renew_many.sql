-- sidelock PostgreSQL backend, schema version 7: many renewals in one
-- statement.
--
-- Every renewal is a write that commits: sent one by one, a sidecar with
-- thousands of holds needs as many commits a second as it renews leases,
-- on its two upkeep connections, and on a slow or loaded database they
-- fell behind until leases lapsed. A sidecar now sends together the
-- renewals that queued while its last statement was on its way: one
-- transaction and one commit for all of them.
--
-- renew_many renews the leases named by the arrays' elements at the same
-- index (kind, name, token, ttl in ms or NULL for the lease's own), as
-- renew() renews one, and returns for each lease it renewed its 1-based
-- index and new expiry. It never waits for a row lock, so one lease that
-- another transaction holds locked neither holds up the others nor takes
-- part in a deadlock (acquire, release, force_release and the heartbeat
-- lock several leases, in their own orders): a live lease that is locked,
-- or named a second time, is returned with a NULL expiry, and the caller
-- renews it alone with renew(), which waits as before. An index it does not
-- return holds nothing. Each lease is looked up by its token alone (the
-- primary key; OFFSET 0 keeps the kind and name out of the lookup, or the
-- planner may walk `leases_key` through a semaphore's thousands of
-- permits for each one).

CREATE FUNCTION {s}.renew_many(p_kinds text[], p_names text[], p_tokens text[], p_ttls bigint[])
RETURNS TABLE (i integer, expires_at_ms bigint)
LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    RETURN QUERY
    WITH asked AS (
        SELECT a.kind, a.name, a.token, a.ttl, a.i::integer AS i
          FROM unnest(p_kinds, p_names, p_tokens, p_ttls) WITH ORDINALITY
               AS a(kind, name, token, ttl, i)
    ), first AS (
        SELECT DISTINCT ON (asked.token) asked.*
          FROM asked
         ORDER BY asked.token, asked.i
    ), locked AS (
        SELECT first.i, first.ttl, l.token
          FROM first
          CROSS JOIN LATERAL (
              SELECT l.token, l.kind, l.name FROM {s}.leases l
               WHERE l.token = first.token AND l.expires_at > v_now
              OFFSET 0
                 FOR UPDATE SKIP LOCKED
          ) l
         WHERE l.kind = first.kind COLLATE "C" AND l.name = first.name COLLATE "C"
    ), renewed AS (
        UPDATE {s}.leases l
           SET expires_at = least(v_now + {s}.millis(coalesce(locked.ttl, l.ttl_ms)),
                                  l.renew_until)
          FROM locked
         WHERE l.token = locked.token
        RETURNING locked.i, l.expires_at
    )
    SELECT renewed.i, {s}.ms(renewed.expires_at) FROM renewed
    UNION ALL
    SELECT asked.i, NULL::bigint
      FROM asked
     WHERE NOT EXISTS (SELECT 1 FROM locked WHERE locked.i = asked.i)
       AND EXISTS (SELECT 1
                     FROM (SELECT l.kind, l.name, l.expires_at FROM {s}.leases l
                            WHERE l.token = asked.token OFFSET 0) l
                    WHERE l.kind = asked.kind COLLATE "C" AND l.name = asked.name COLLATE "C"
                      AND l.expires_at > v_now);
END
$fn$;
