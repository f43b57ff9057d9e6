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
-- renew() renews one, and returns the 1-based index and the new expiry of
-- each lease it renewed; a lease it does not return holds nothing. A token
-- appears at most once (the caller sends a second renewal of one lease in
-- the next statement). Rows are locked in token order, as no other
-- function locks several leases of different keys.

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
        SELECT a.kind, a.name, a.token, a.ttl, a.i
          FROM unnest(p_kinds, p_names, p_tokens, p_ttls) WITH ORDINALITY
               AS a(kind, name, token, ttl, i)
    ), locked AS (
        SELECT l.token, asked.i, asked.ttl
          FROM {s}.leases l
          JOIN asked ON l.token = asked.token
                    AND l.kind = asked.kind COLLATE "C"
                    AND l.name = asked.name COLLATE "C"
         WHERE l.expires_at > v_now
         ORDER BY l.token
           FOR UPDATE OF l
    ), renewed AS (
        UPDATE {s}.leases l
           SET expires_at = least(v_now + {s}.millis(coalesce(locked.ttl, l.ttl_ms)),
                                  l.renew_until)
          FROM locked
         WHERE l.token = locked.token
        RETURNING locked.i, l.expires_at
    )
    SELECT renewed.i::integer, {s}.ms(renewed.expires_at) FROM renewed;
END
$fn$;
