-- sidelock PostgreSQL backend, schema version 11: a renewal never shortens
-- a lease.
--
-- renew and renew_many set a lease's expiry to now + ttl, also when that
-- was sooner than its expiry: a hold stream's watchdog renewing to its own
-- ttl through one sidecar cut short the end a re-entry through another
-- sidecar had given the lease (and told its client), and once the stream
-- closed the lease lapsed while that client still held it. A renewal now
-- takes the later of the two, as a re-entry does (never past the lease's
-- max_hold cap, renew_until). Only these two functions change.

CREATE OR REPLACE FUNCTION {s}.renew(p_kind text, p_name text, p_token text, p_ttl_ms bigint)
RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_expires timestamptz;
BEGIN
    UPDATE {s}.leases
       SET expires_at = greatest(expires_at,
                                 least(v_now + {s}.millis(coalesce(p_ttl_ms, ttl_ms)), renew_until))
     WHERE token = p_token AND kind = p_kind AND name = p_name AND expires_at > v_now
    RETURNING expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN json_build_object('expires_at_ms', {s}.ms(v_expires), 'now_ms', {s}.ms(v_now));
END
$fn$;

CREATE OR REPLACE FUNCTION {s}.renew_many(p_kinds text[], p_names text[], p_tokens text[], p_ttls bigint[])
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
           SET expires_at = greatest(l.expires_at,
                                     least(v_now + {s}.millis(coalesce(locked.ttl, l.ttl_ms)),
                                           l.renew_until))
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
