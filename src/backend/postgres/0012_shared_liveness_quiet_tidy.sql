-- sidelock PostgreSQL backend, schema version 12: releases that ask at once
-- whether a sidecar lives agree that a killed one is dead, and the
-- heartbeat's cleanup of expired leases wakes only keys someone waits for.
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
-- exclusive). pass_on's body is as in version 6 but for the try.
--
-- heartbeat() woke every key whose expired leases it removed, a NOTIFY on
-- the channel every sidecar listens on, also with nobody waiting; the
-- monitor's housekeeping now goes on while its batches come back full, so
-- per-job locks left to expire would send thousands a second. It wakes a
-- key now only when claims are queued for it (keys.queued) or it is an
-- election (whose observers follow it). Its body is as in version 6 but
-- for that.

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


CREATE OR REPLACE FUNCTION {s}.heartbeat(p_instance text, p_sidecar text, p_lapse_ms bigint,
                                         p_live bigint[], p_gone bigint[], p_ghost_ms bigint)
RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_queued bigint;
    v_now timestamptz := clock_timestamp();
    v_waiters bigint := 0;
    v_ghosts bigint;
    v_leases bigint := 0;
    v_n bigint;
    v_end timestamptz;
    r record;
BEGIN
    -- Before its own row is written: waiting for keys while holding that
    -- row would deadlock with its leave() (keys, then the row) and with
    -- its acquires re-creating the row (present(), under a key's lock).
    v_ghosts := {s}.drop_waiters(
        ARRAY(SELECT seq FROM {s}.waiters
               WHERE instance = p_instance
                 AND (seq = ANY (p_gone)
                      OR (seq <> ALL (p_live)
                          AND queued_at < v_now - {s}.millis(p_ghost_ms)))),
        true);

    INSERT INTO {s}.sidecars (instance, sidecar, started_at, heartbeat_at)
    VALUES (p_instance, p_sidecar, v_now, v_now)
    ON CONFLICT (instance) DO UPDATE SET heartbeat_at = excluded.heartbeat_at;

    FOR r IN SELECT instance FROM {s}.sidecars
              WHERE heartbeat_at <= v_now - {s}.millis(p_lapse_ms)
              FOR UPDATE SKIP LOCKED LOOP
        v_waiters := v_waiters + {s}.drop_waiters(
            ARRAY(SELECT seq FROM {s}.waiters WHERE instance = r.instance), false);
        IF NOT EXISTS (SELECT 1 FROM {s}.waiters WHERE instance = r.instance) THEN
            DELETE FROM {s}.sidecars WHERE instance = r.instance;
        END IF;
    END LOOP;

    FOR r IN SELECT DISTINCT kind, name FROM {s}.leases WHERE expires_at <= v_now LIMIT 1000 LOOP
        PERFORM 1 FROM {s}.keys WHERE kind = r.kind AND name = r.name
            FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        WITH gone AS (
            DELETE FROM {s}.leases
             WHERE kind = r.kind AND name = r.name AND expires_at <= v_now
            RETURNING expires_at + {s}.millis(lock_delay_ms) AS delay_end)
        SELECT count(*), max(delay_end) INTO v_n, v_end FROM gone;
        IF v_n > 0 THEN
            UPDATE {s}.keys SET delay_until = greatest(delay_until, v_end)
             WHERE kind = r.kind AND name = r.name
            RETURNING queued INTO v_queued;
            -- Only waiters, and an election's observers, need to hear.
            IF v_queued > 0 OR r.kind = 'election' THEN
                PERFORM {s}.wake(r.kind, r.name);
            END IF;
            v_leases := v_leases + v_n;
        END IF;
    END LOOP;

    RETURN json_build_object('now_ms', {s}.ms(v_now), 'ghosts', v_ghosts, 'waiters', v_waiters,
                             'leases', v_leases);
END
$fn$;
