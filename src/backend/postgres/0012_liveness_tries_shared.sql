-- sidelock PostgreSQL backend, schema version 12: releases that ask at once
-- whether a sidecar lives agree that a killed one is dead.
--
-- pass_on() asked whether a waiter's sidecar lives by trying its instance's
-- advisory lock for the transaction, exclusively: a release that had passed
-- a killed sidecar's waiter by on one lock held that lock until it
-- committed, so another release's try at the same moment failed, read the
-- sidecar as alive and handed its lock to the dead waiter (held by nobody
-- until its ttl). The try is now for the lock shared: the live sidecar's
-- LISTEN connection holds it exclusively, which still fails the try, and
-- shared tries do not exclude each other. A LISTEN connection coming back
-- waits for such a transaction, as it did (its pg_advisory_lock is
-- exclusive). Only pass_on changes: its body as in version 6 but for the
-- try.

CREATE OR REPLACE FUNCTION {s}.pass_on(p_kind text, p_name text, p_now timestamptz, p_lapse_ms bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    w {s}.waiters%ROWTYPE;
    v_fence bigint;
    v_cap timestamptz;
    v_expires timestamptz;
BEGIN
    LOOP
        SELECT * INTO w FROM {s}.waiters
         WHERE (kind, name) >= (p_kind, p_name) AND (kind, name) <= (p_kind, p_name)
         ORDER BY kind, name, seq LIMIT 1;
        -- Nobody waits: only an election's observers need to hear (a
        -- NOTIFY on the shared channel costs every listening sidecar a
        -- transaction).
        IF NOT FOUND THEN
            IF p_kind = 'election' THEN
                PERFORM {s}.wake(p_kind, p_name);
            END IF;
            RETURN;
        END IF;
        IF w.token IS NULL OR w.mode <> 'exclusive' OR p_kind = 'semaphore'
           OR EXISTS (SELECT 1 FROM {s}.keys
                       WHERE kind = p_kind AND name = p_name AND delay_until > p_now) THEN
            PERFORM {s}.wake(p_kind, p_name);
            RETURN;
        END IF;
        -- Alive: it heartbeats, and its LISTEN connection holds its
        -- instance's advisory lock (a killed sidecar's goes at once; taking
        -- it here for the transaction, shared, says nobody holds it: other
        -- releases asking the same at once take it too).
        EXIT WHEN EXISTS (SELECT 1 FROM {s}.sidecars c
                           WHERE c.instance = w.instance
                             AND c.heartbeat_at > p_now - {s}.millis(p_lapse_ms))
              AND NOT pg_try_advisory_xact_lock_shared(hashtextextended('sidelock instance ' || w.instance, 0));
        DELETE FROM {s}.waiters WHERE seq = w.seq;
    END LOOP;

    UPDATE {s}.keys SET fence = fence + 1 WHERE kind = p_kind AND name = p_name
    RETURNING fence INTO v_fence;
    v_cap := p_now + {s}.millis(w.max_hold_ms);
    v_expires := least(p_now + {s}.millis(w.ttl_ms), v_cap);
    INSERT INTO {s}.leases (token, kind, name, owner, sidecar, mode, fence, hold_count,
                            acquired_at, expires_at, renew_until, ttl_ms, lock_delay_ms)
    VALUES (w.token, p_kind, p_name, w.owner, w.sidecar, 'exclusive', v_fence, 1,
            p_now, v_expires, v_cap, w.ttl_ms, w.lock_delay_ms);
    DELETE FROM {s}.waiters WHERE seq = w.seq;
    PERFORM pg_notify({s}.own_channel(w.instance),
                      'g ' || w.instance || ' ' || w.seq || ' ' || v_fence || ' '
                      || {s}.ms(p_now) || ' ' || {s}.ms(v_expires) || ' '
                      || {s}.key_text(p_kind, p_name));
END
$fn$;
