-- sidelock PostgreSQL backend, schema version 9: force-releases recorded.
--
-- A force-release through one sidecar reached the holder's sidecar only as
-- a lease that had gone (`lost` with reason `backend`). force_release now
-- notes each live lease it removes in `forced` until a minute past the
-- lease's expiry; the holder's sidecar, finding its lease gone, reads it
-- there (`status`, by token) and reports `force_released`. Each call first
-- deletes the notes past their time, so the table holds only notes of
-- leases that would still hold, or ended less than a minute ago (and those
-- of the last call).

CREATE TABLE {s}.forced (
    token text PRIMARY KEY,
    until timestamptz NOT NULL
);

CREATE OR REPLACE FUNCTION {s}.force_release(p_kind text, p_name text) RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_now timestamptz;
    v_n bigint;
    v_end timestamptz;
    v_tokens json;
BEGIN
    PERFORM 1 FROM {s}.keys WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN '[]'::json;
    END IF;
    v_now := clock_timestamp();
    DELETE FROM {s}.forced WHERE until < v_now;
    WITH gone AS (
        DELETE FROM {s}.leases WHERE kind = p_kind AND name = p_name
        RETURNING token, fence, expires_at, lock_delay_ms),
    noted AS (
        INSERT INTO {s}.forced AS f (token, until)
        SELECT token, expires_at + interval '1 minute' FROM gone WHERE expires_at > v_now
        ON CONFLICT (token) DO UPDATE SET until = greatest(f.until, excluded.until))
    SELECT count(*),
           max(least(expires_at, v_now) + {s}.millis(lock_delay_ms)),
           coalesce(json_agg(token ORDER BY fence) FILTER (WHERE expires_at > v_now), '[]'::json)
      INTO v_n, v_end, v_tokens
      FROM gone;
    IF v_n > 0 THEN
        UPDATE {s}.keys SET delay_until = greatest(delay_until, v_end)
         WHERE kind = p_kind AND name = p_name;
        PERFORM {s}.wake(p_kind, p_name);
    END IF;
    RETURN v_tokens;
END
$fn$;
