-- sidelock PostgreSQL backend, schema version 8: a queued attempt run
-- again after its connection broke.
--
-- A waiter woken by a release looks with acquire(p_turn => 'queued'); when
-- that look's connection breaks, the database may have run it (granted,
-- re-entered, or left it queued) without its sidecar hearing. The sidecar
-- now runs the look once more, with p_turn => 'again', instead of failing
-- a waiter that may have long to wait still:
--
-- * a grant the first run made is found by its token and answered as is
--   (as a handoff its sidecar did not hear of always was);
-- * a ticket whose row has gone is not put back (the first run may have
--   re-entered its owner's lease, which answers under that lease's token
--   and removes the row): it answers 'unsure', and the first run's failure
--   stands;
-- * otherwise the look runs as a queued one, re-entry included: the row
--   is there, under the key's row lock, so the first run made no grant and
--   no re-entry (either removes the row in its own transaction).
--
-- Same signature as version 6, so older sidecars call the same function.

CREATE OR REPLACE FUNCTION {s}.acquire(
    p_kind text, p_name text, p_mode text, p_owner text, p_sidecar text, p_instance text,
    p_token text, p_ttl_ms bigint, p_limit integer, p_lock_delay_ms bigint,
    p_max_hold_ms bigint, p_turn text, p_seq bigint, p_lapse_ms bigint, p_handoff boolean)
RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    k        {s}.keys%ROWTYPE;
    k0       {s}.keys%ROWTYPE;
    v_now    timestamptz;
    v_wake   boolean := false;
    v_n      bigint;
    v_end    timestamptz;
    v_live   bigint;
    v_queue  bigint;
    v_ahead  bigint;
    v_fits   boolean;
    v_free   boolean;
    v_dead   text;
    v_turn   boolean;
    v_lease  {s}.leases%ROWTYPE;
    v_seq    bigint;
    v_pos    bigint;
    v_retry  timestamptz;
    v_cap    timestamptz;
    v_result json;
    v_token  text := CASE WHEN p_handoff THEN p_token END;
    v_again  boolean := p_turn = 'again';
BEGIN
    IF v_again THEN
        p_turn := 'queued';
    END IF;
    SELECT * INTO k FROM {s}.keys WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        INSERT INTO {s}.keys (kind, name) VALUES (p_kind, p_name) ON CONFLICT DO NOTHING;
        SELECT * INTO k FROM {s}.keys WHERE kind = p_kind AND name = p_name FOR NO KEY UPDATE;
    END IF;
    k0 := k;
    v_now := clock_timestamp();

    -- An expired lease is free: delete it, starting its lock-delay.
    WITH gone AS (
        DELETE FROM {s}.leases
        WHERE kind = p_kind AND name = p_name AND expires_at <= v_now
        RETURNING expires_at + {s}.millis(lock_delay_ms) AS delay_end)
    SELECT count(*), max(delay_end) INTO v_n, v_end FROM gone;
    IF v_n > 0 THEN
        k.delay_until := greatest(k.delay_until, v_end);
        v_wake := true;
    END IF;

    -- Waiters of sidecars that stopped heartbeating leave the queue. Looked
    -- for through `sidecars` (one row per process), then by sidecar and key
    -- (`waiters_instance_key`), never through the whole queue.
    FOR v_dead IN SELECT instance FROM {s}.sidecars
                   WHERE k.queued > 0 AND heartbeat_at <= v_now - {s}.millis(p_lapse_ms)
                     AND instance <> p_instance LOOP
        DELETE FROM {s}.waiters
         WHERE instance = v_dead AND kind = p_kind AND name = p_name;
        IF FOUND THEN
            v_wake := true;
        END IF;
    END LOOP;

    -- A waiter row without a live sidecar row (written by hand, or left by
    -- a join racing its sidecar's shutdown) is looked for only when the
    -- queue alone would hold this claim back and its head is such a row:
    -- then the whole queue is read.
    SELECT queued INTO v_queue FROM {s}.keys WHERE kind = p_kind AND name = p_name;
    v_free := v_queue > 0 AND CASE
        WHEN p_kind = 'semaphore' THEN
            (SELECT count(*) FROM {s}.leases WHERE kind = p_kind AND name = p_name)
                < coalesce(k.permits, p_limit)
        WHEN p_mode = 'exclusive' THEN
            NOT EXISTS (SELECT 1 FROM {s}.leases WHERE kind = p_kind AND name = p_name)
        ELSE
            NOT EXISTS (SELECT 1 FROM {s}.leases
                         WHERE kind = p_kind AND name = p_name AND mode = 'exclusive')
    END;
    IF v_free AND (k.delay_until IS NULL OR v_now >= k.delay_until)
       AND EXISTS (SELECT 1 FROM (SELECT instance FROM {s}.waiters
                                   WHERE (kind, name) >= (p_kind, p_name)
                                     AND (kind, name, seq) < (p_kind, p_name,
                                          CASE WHEN p_turn = 'queued' THEN p_seq
                                               ELSE 9223372036854775807 END)
                                   ORDER BY kind, name, seq LIMIT 1) head
                    WHERE head.instance <> p_instance
                      AND NOT EXISTS (SELECT 1 FROM {s}.sidecars c
                                       WHERE c.instance = head.instance
                                         AND c.heartbeat_at > v_now - {s}.millis(p_lapse_ms))) THEN
        WITH gone AS (
            DELETE FROM {s}.waiters w
            WHERE w.kind = p_kind AND w.name = p_name AND w.instance <> p_instance
              AND NOT EXISTS (SELECT 1 FROM {s}.sidecars c
                               WHERE c.instance = w.instance
                                 AND c.heartbeat_at > v_now - {s}.millis(p_lapse_ms))
            RETURNING 1)
        SELECT count(*) INTO v_n FROM gone;
        IF v_n > 0 THEN
            v_wake := true;
        END IF;
    END IF;

    <<decide>>
    BEGIN
        -- Handed over while its sidecar did not hear of it.
        IF p_turn = 'queued' AND p_handoff THEN
            SELECT * INTO v_lease FROM {s}.leases
             WHERE token = p_token AND kind = p_kind AND name = p_name;
            IF FOUND THEN
                DELETE FROM {s}.waiters WHERE seq = p_seq AND kind = p_kind AND name = p_name;
                v_result := {s}.granted(v_lease, v_now);
                EXIT decide;
            END IF;
        END IF;

        -- A run again whose ticket has gone cannot tell whether its first
        -- run took it (a re-entry answers under its owner's lease's token).
        IF v_again AND NOT EXISTS (SELECT 1 FROM {s}.waiters WHERE seq = p_seq) THEN
            v_result := json_build_object('outcome', 'unsure');
            EXIT decide;
        END IF;

        -- A ticket removed while its sidecar could not heartbeat takes its place back.
        IF p_turn = 'queued' AND NOT EXISTS (SELECT 1 FROM {s}.waiters WHERE seq = p_seq) THEN
            PERFORM {s}.present(p_instance, p_sidecar, v_now);
            INSERT INTO {s}.waiters (seq, kind, name, owner, sidecar, instance, mode, queued_at,
                                     token, ttl_ms, max_hold_ms, lock_delay_ms)
            VALUES (p_seq, p_kind, p_name, p_owner, p_sidecar, p_instance, p_mode, v_now,
                    v_token, p_ttl_ms, p_max_hold_ms, p_lock_delay_ms);
        END IF;

        SELECT count(*) INTO v_live FROM {s}.leases WHERE kind = p_kind AND name = p_name;
        SELECT queued INTO v_queue FROM {s}.keys WHERE kind = p_kind AND name = p_name;

        IF p_kind = 'semaphore' THEN
            -- An idle semaphore may be reused with another limit.
            IF v_live = 0 AND v_queue = 0 THEN
                k.permits := NULL;
            END IF;
            IF k.permits IS NOT NULL AND p_limit IS NOT NULL AND k.permits <> p_limit THEN
                v_result := json_build_object('outcome', 'limit_mismatch', 'active', k.permits);
                EXIT decide;
            ELSIF k.permits IS NULL AND p_limit IS NULL THEN
                v_result := json_build_object('outcome', 'limit_required');
                EXIT decide;
            ELSIF k.permits IS NULL THEN
                k.permits := p_limit;
            END IF;
        ELSE
            -- Re-entry: the same owner in the same mode, regardless of the queue.
            UPDATE {s}.leases
               SET hold_count = hold_count + 1,
                   expires_at = least(greatest(expires_at, v_now + {s}.millis(p_ttl_ms)),
                                      renew_until)
             WHERE token = (SELECT token FROM {s}.leases
                             WHERE kind = p_kind AND name = p_name
                               AND owner = p_owner AND mode = p_mode
                             ORDER BY fence LIMIT 1)
            RETURNING * INTO v_lease;
            IF FOUND THEN
                IF p_turn = 'queued' THEN
                    DELETE FROM {s}.waiters WHERE seq = p_seq AND kind = p_kind AND name = p_name;
                END IF;
                v_result := {s}.granted(v_lease, v_now);
                EXIT decide;
            END IF;
        END IF;

        v_fits := CASE
            WHEN p_kind = 'semaphore' THEN v_live < k.permits
            WHEN p_mode = 'exclusive' THEN v_live = 0
            ELSE NOT EXISTS (SELECT 1 FROM {s}.leases
                             WHERE kind = p_kind AND name = p_name AND mode = 'exclusive')
        END;
        IF p_turn = 'queued' THEN
            SELECT count(*) INTO v_ahead FROM {s}.waiters
             WHERE (kind, name) >= (p_kind, p_name) AND (kind, name, seq) < (p_kind, p_name, p_seq);
            v_turn := CASE
                WHEN p_kind = 'semaphore' THEN v_ahead < k.permits - v_live
                WHEN p_mode = 'exclusive' THEN v_ahead = 0
                ELSE NOT EXISTS (SELECT 1 FROM {s}.waiters
                                 WHERE (kind, name) >= (p_kind, p_name)
                                   AND (kind, name, seq) < (p_kind, p_name, p_seq)
                                   AND mode <> 'shared')
            END;
        ELSE
            -- Fairness: nobody overtakes the queue.
            v_turn := v_queue = 0;
        END IF;

        IF (k.delay_until IS NULL OR v_now >= k.delay_until) AND v_fits AND v_turn THEN
            k.fence := k.fence + 1;
            v_cap := v_now + {s}.millis(p_max_hold_ms);
            INSERT INTO {s}.leases (token, kind, name, owner, sidecar, mode, fence, hold_count,
                                    acquired_at, expires_at, renew_until, ttl_ms, lock_delay_ms)
            VALUES (p_token, p_kind, p_name, p_owner, p_sidecar, p_mode, k.fence, 1,
                    v_now, least(v_now + {s}.millis(p_ttl_ms), v_cap), v_cap,
                    p_ttl_ms, p_lock_delay_ms)
            RETURNING * INTO v_lease;
            IF p_turn = 'queued' THEN
                DELETE FROM {s}.waiters WHERE seq = p_seq AND kind = p_kind AND name = p_name;
                -- Readers and permits behind this one may be admitted too.
                IF (p_kind = 'semaphore' OR p_mode = 'shared') AND v_queue > 1 THEN
                    v_wake := true;
                END IF;
            END IF;
            v_result := {s}.granted(v_lease, v_now);
            EXIT decide;
        END IF;

        -- Busy. The blocking state lapses by itself at the end of the
        -- lock-delay or at the first conflicting lease's expiry.
        IF k.delay_until > v_now THEN
            v_retry := k.delay_until;
        ELSE
            SELECT min(expires_at) INTO v_retry FROM {s}.leases
             WHERE kind = p_kind AND name = p_name
               AND (p_mode = 'exclusive' OR mode = 'exclusive');
        END IF;
        IF p_turn = 'join' THEN
            PERFORM {s}.present(p_instance, p_sidecar, v_now);
            INSERT INTO {s}.waiters (kind, name, owner, sidecar, instance, mode, queued_at,
                                     token, ttl_ms, max_hold_ms, lock_delay_ms)
            VALUES (p_kind, p_name, p_owner, p_sidecar, p_instance, p_mode, v_now,
                    v_token, p_ttl_ms, p_max_hold_ms, p_lock_delay_ms)
            RETURNING seq INTO v_seq;
            v_queue := v_queue + 1;
            v_pos := v_queue;
        ELSIF p_turn = 'queued' THEN
            v_pos := v_ahead + 1;
        END IF;
        v_result := json_build_object(
            'outcome', 'busy', 'holders', {s}.holders(p_kind, p_name, v_now),
            'queue_length', v_queue, 'position', v_pos, 'seq', v_seq,
            'retry_at_ms', {s}.ms(v_retry), 'now_ms', {s}.ms(v_now));
    END decide;

    IF k IS DISTINCT FROM k0 THEN
        UPDATE {s}.keys SET fence = k.fence, permits = k.permits, delay_until = k.delay_until
         WHERE kind = p_kind AND name = p_name;
    END IF;
    IF v_wake THEN
        PERFORM {s}.wake(p_kind, p_name);
    END IF;
    RETURN v_result;
END
$fn$;


