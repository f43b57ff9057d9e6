-- sidelock PostgreSQL backend, schema version 5: a release clears the key's
-- expired leases first.
--
-- In version 4, the release of the last live lease of a key passed the lock
-- on (pass_on) while other leases of the key had expired without anyone
-- deleting them yet — a reader whose client went away — so their lock-delay,
-- which starts when such a lease is deleted (keys.delay_until), was never
-- recorded, and a waiting writer was granted at once. The release now
-- deletes them and records their lock-delay, as acquire does, before it
-- decides; pass_on then finds the delay and wakes instead of granting.

CREATE OR REPLACE FUNCTION {s}.release(p_kind text, p_name text, p_token text, p_lapse_ms bigint)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_count integer;
    v_expires timestamptz;
    v_now timestamptz;
    v_end timestamptz;
BEGIN
    PERFORM 1 FROM {s}.keys WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
    v_now := clock_timestamp();
    SELECT hold_count, expires_at INTO v_count, v_expires FROM {s}.leases
     WHERE token = p_token AND kind = p_kind AND name = p_name
     FOR UPDATE;
    IF NOT FOUND OR v_expires <= v_now THEN
        RETURN NULL;
    END IF;
    IF v_count > 1 THEN
        UPDATE {s}.leases SET hold_count = hold_count - 1 WHERE token = p_token;
        RETURN v_count - 1;
    END IF;
    DELETE FROM {s}.leases WHERE token = p_token;
    -- Expired leases of the key are free, after their lock-delay.
    WITH gone AS (
        DELETE FROM {s}.leases
        WHERE kind = p_kind AND name = p_name AND expires_at <= v_now
        RETURNING expires_at + {s}.millis(lock_delay_ms) AS delay_end)
    SELECT max(delay_end) INTO v_end FROM gone;
    IF v_end > v_now THEN
        UPDATE {s}.keys SET delay_until = greatest(delay_until, v_end)
         WHERE kind = p_kind AND name = p_name;
    END IF;
    IF EXISTS (SELECT 1 FROM {s}.leases WHERE kind = p_kind AND name = p_name) THEN
        PERFORM {s}.wake(p_kind, p_name);
    ELSE
        PERFORM {s}.pass_on(p_kind, p_name, v_now, p_lapse_ms);
    END IF;
    RETURN 0;
END
$fn$;
