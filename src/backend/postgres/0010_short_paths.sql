-- sidelock PostgreSQL backend, schema version 10: the free exclusive lock
-- granted, a claim behind a live holder queued, and a lock's only lease
-- released (and the lock passed on), in a few statements.
--
-- An uncontended acquire and release ran about twenty statements inside
-- the functions (expired leases, dead sidecars' waiters, the queue length
-- twice, a re-entry look, ...), and both waited for their WAL flush. Now:
--
-- * `acquire` grants a free exclusive lock nobody waits for — its key's row
--   there, no lease row of any kind, an empty queue, no lock-delay running —
--   with the row lock, one look at the leases, the fence and the lease row,
--   exactly as version 8's function decides in that state (which deletes and
--   wakes nothing there). A claim on an exclusive lock held by other owners'
--   live leases, with no sidecar's heartbeat lapsed while claims wait, is
--   answered busy (and a join queued) with that lock, one look at the
--   leases and the waiter row, as version 8 answers it. Anything else goes
--   to that function, now named `acquire_full`, in the same transaction.
-- * `release` of a lock whose only lease is the caller's (one hold, not
--   expired) deletes it and, when claims are queued, passes the lock on
--   (pass_on): version 5's function frees no expired lease and starts no
--   lock-delay there, and passes on the same way (with nobody queued,
--   pass_on does nothing for a lock). Anything else goes to that function,
--   now `release_full`.
--   Sent as a statement of its own (the new `p_alone`, which the sidecar
--   passes), that release with nobody queued also commits without waiting
--   for its WAL flush
--   (`synchronous_commit` off for its transaction): losing it in a server
--   crash leaves a released lease in place until its own expiry and
--   lock-delay (or its owner re-enters it) — a lock free later than it
--   could be, never two holders, no fence given twice — and any later
--   grant's commit flushes it anyway (WAL is written in order). A release
--   with claims queued still waits: the waiter it hands the lock to is told
--   it holds it. Not for callers that write after it in the same
--   transaction: the setting lasts until its end.
--
-- Same signatures, so older sidecars call the same functions; later
-- versions change `acquire_full` and `release_full` for everything but
-- these short paths (and the short paths with them).

ALTER FUNCTION {s}.acquire(text, text, text, text, text, text, text, bigint, integer, bigint,
                           bigint, text, bigint, bigint, boolean)
    RENAME TO acquire_full;
ALTER FUNCTION {s}.release(text, text, text, bigint) RENAME TO release_full;

CREATE FUNCTION {s}.acquire(
    p_kind text, p_name text, p_mode text, p_owner text, p_sidecar text, p_instance text,
    p_token text, p_ttl_ms bigint, p_limit integer, p_lock_delay_ms bigint,
    p_max_hold_ms bigint, p_turn text, p_seq bigint, p_lapse_ms bigint, p_handoff boolean)
RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_fence  bigint;
    v_queued bigint;
    v_delay  timestamptz;
    v_now    timestamptz;
    v_cap    timestamptz;
    v_end    timestamptz;
    v_live   bigint;
    v_fresh  boolean;
    v_mine   boolean;
    v_retry  timestamptz;
    v_seq    bigint;
    v_pos    bigint;
BEGIN
    IF p_kind = 'lock' AND p_mode = 'exclusive' AND p_turn IN ('once', 'join') THEN
        SELECT fence, queued, delay_until INTO v_fence, v_queued, v_delay FROM {s}.keys
         WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
        -- After the row lock, as acquire_full reads it.
        v_now := clock_timestamp();
        IF v_queued = 0 AND (v_delay IS NULL OR v_delay <= v_now) THEN
            -- Under the row lock: every statement that adds a lease takes it.
            UPDATE {s}.keys SET fence = fence + 1
             WHERE kind = p_kind AND name = p_name
               AND NOT EXISTS (SELECT 1 FROM {s}.leases WHERE kind = p_kind AND name = p_name)
            RETURNING fence INTO v_fence;
        ELSE
            v_fence := NULL;
        END IF;
        IF v_fence IS NOT NULL THEN
            v_cap := v_now + {s}.millis(p_max_hold_ms);
            v_end := least(v_now + {s}.millis(p_ttl_ms), v_cap);
            INSERT INTO {s}.leases (token, kind, name, owner, sidecar, mode, fence, hold_count,
                                    acquired_at, expires_at, renew_until, ttl_ms, lock_delay_ms)
            VALUES (p_token, p_kind, p_name, p_owner, p_sidecar, p_mode, v_fence, 1,
                    v_now, v_end, v_cap, p_ttl_ms, p_lock_delay_ms);
            RETURN json_build_object('outcome', 'granted', 'token', p_token, 'fence', v_fence,
                                     'count', 1, 'since_ms', {s}.ms(v_now),
                                     'expires_at_ms', {s}.ms(v_end), 'now_ms', {s}.ms(v_now));
        END IF;
        -- Busy behind live leases, none of them this owner's to re-enter,
        -- and no sidecar's heartbeat lapsed while claims wait (whose
        -- waiters acquire_full would remove): acquire_full would answer
        -- busy having changed nothing, and a join would queue.
        IF v_queued IS NOT NULL THEN
            SELECT count(*), bool_and(expires_at > v_now),
                   bool_or(owner = p_owner AND mode = p_mode), min(expires_at)
              INTO v_live, v_fresh, v_mine, v_retry
              FROM {s}.leases WHERE kind = p_kind AND name = p_name;
            IF v_live > 0 AND v_fresh AND NOT v_mine
               AND (v_queued = 0
                    OR NOT EXISTS (SELECT 1 FROM {s}.sidecars
                                    WHERE heartbeat_at <= v_now - {s}.millis(p_lapse_ms)
                                      AND instance <> p_instance)) THEN
                IF v_delay > v_now THEN
                    v_retry := v_delay;
                END IF;
                IF p_turn = 'join' THEN
                    PERFORM {s}.present(p_instance, p_sidecar, v_now);
                    INSERT INTO {s}.waiters (kind, name, owner, sidecar, instance, mode,
                                             queued_at, token, ttl_ms, max_hold_ms,
                                             lock_delay_ms)
                    VALUES (p_kind, p_name, p_owner, p_sidecar, p_instance, p_mode, v_now,
                            CASE WHEN p_handoff THEN p_token END, p_ttl_ms, p_max_hold_ms,
                            p_lock_delay_ms)
                    RETURNING seq INTO v_seq;
                    v_queued := v_queued + 1;
                    v_pos := v_queued;
                END IF;
                RETURN json_build_object(
                    'outcome', 'busy', 'holders', {s}.holders(p_kind, p_name, v_now),
                    'queue_length', v_queued, 'position', v_pos, 'seq', v_seq,
                    'retry_at_ms', {s}.ms(v_retry), 'now_ms', {s}.ms(v_now));
            END IF;
        END IF;
    END IF;
    RETURN {s}.acquire_full(p_kind, p_name, p_mode, p_owner, p_sidecar, p_instance, p_token,
                            p_ttl_ms, p_limit, p_lock_delay_ms, p_max_hold_ms, p_turn, p_seq,
                            p_lapse_ms, p_handoff);
END
$fn$;

-- Release; `p_alone`: the caller sends it as a statement of its own (as
-- the sidecar does), so that nothing written after it in its transaction
-- would share its commit.
CREATE FUNCTION {s}.release(p_kind text, p_name text, p_token text, p_lapse_ms bigint,
                            p_alone boolean)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    -- Nothing written before this call in its transaction either (the row
    -- lock below takes a transaction id). txid_: PostgreSQL 11 and 12 too.
    v_alone   boolean := p_alone AND txid_current_if_assigned() IS NULL;
    v_queued  bigint;
    v_now     timestamptz;
    v_setting text;
BEGIN
    IF p_kind = 'lock' THEN
        SELECT queued INTO v_queued FROM {s}.keys
         WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
        IF v_queued IS NOT NULL THEN
            -- After the row lock, as release_full reads it.
            v_now := clock_timestamp();
            -- The caller's last hold of the key's only lease, unexpired:
            -- release_full would find no other lease, expired or not, and
            -- pass the lock on (nobody queued: pass_on does nothing).
            DELETE FROM {s}.leases
             WHERE token = p_token AND kind = p_kind AND name = p_name AND hold_count = 1
               AND expires_at > v_now
               AND NOT EXISTS (SELECT 1 FROM {s}.leases
                                WHERE kind = p_kind AND name = p_name AND token <> p_token);
            IF FOUND THEN
                IF v_queued <> 0 THEN
                    PERFORM {s}.pass_on(p_kind, p_name, v_now, p_lapse_ms);
                ELSIF v_alone THEN
                    v_setting := set_config('synchronous_commit', 'off', true);
                END IF;
                RETURN 0;
            END IF;
        END IF;
    END IF;
    RETURN {s}.release_full(p_kind, p_name, p_token, p_lapse_ms);
END
$fn$;

-- The previous signature, for older sidecars and dequeue(): the short path,
-- committed as the server is configured.
CREATE FUNCTION {s}.release(p_kind text, p_name text, p_token text, p_lapse_ms bigint)
RETURNS integer
LANGUAGE sql VOLATILE
AS $$ SELECT {s}.release(p_kind, p_name, p_token, p_lapse_ms, false) $$;
