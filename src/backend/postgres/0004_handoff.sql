-- sidelock PostgreSQL backend, schema version 4: a release hands the lock over.
--
-- Before, a release deleted the lease and sent NOTIFY; every sidecar's
-- local queue head then tried (one acquire each, all but one in vain), and
-- the waiter that got in had joined with another: 5 to 7 transactions per
-- handoff. Now a waiter row keeps the lease it asks for (its token, ttl,
-- max_hold and lock_delay), and the release of an exclusive lock grants it
-- to the first waiter in line in its own transaction — the lease row, the
-- next fence — telling that waiter's sidecar with
-- `NOTIFY <channel>_<instance>, 'g <instance> <seq> <fence> <since ms> <expires ms> <key>'`
-- on that sidecar's own channel: a handoff is the release and the next
-- join, 2 transactions (and the listening sidecar's, 1, to read the
-- notification). A release with nobody waiting notifies nobody, unless the
-- key is an election's (its observers hear). Waiters of
-- sidecars that stopped heartbeating, or whose LISTEN connection is gone
-- (it holds an advisory lock on the instance), are passed by; a live one
-- passed by while reconnecting queues again at its place when it looks.
--
-- Sidecars of versions 1 to 3 keep working on this schema: they call the
-- acquire, release and dequeue of the old signatures, which remain, and
-- their waiter rows carry no token, so a release wakes them (as before)
-- rather than handing them a lease they would not hear of.

ALTER TABLE {s}.waiters
    ADD COLUMN token text,
    ADD COLUMN ttl_ms bigint,
    ADD COLUMN max_hold_ms bigint,
    ADD COLUMN lock_delay_ms bigint;

-- A sidecar process's own channel, which its listening connection LISTENs
-- on beside the shared one: `<schema>_wake_<first 8 characters of its
-- instance>` (at most 62 bytes; two instances that share the 8 characters
-- hear each other's handoffs and ignore them).
CREATE FUNCTION {s}.own_channel(p_instance text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT {channel} || '_' || left(p_instance, 8) $$;

-- With the key's row lock held and its leases gone: grants an exclusive
-- lock to the first waiter in line whose sidecar lives and that carries its
-- lease (joined through version 4), or wakes the key's waiters.
CREATE FUNCTION {s}.pass_on(p_kind text, p_name text, p_now timestamptz, p_lapse_ms bigint)
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
         WHERE kind = p_kind AND name = p_name ORDER BY seq LIMIT 1;
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
        -- it here for the transaction says nobody holds it).
        EXIT WHEN EXISTS (SELECT 1 FROM {s}.sidecars c
                           WHERE c.instance = w.instance
                             AND c.heartbeat_at > p_now - {s}.millis(p_lapse_ms))
              AND NOT pg_try_advisory_xact_lock(hashtextextended('sidelock instance ' || w.instance, 0));
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

-- Acquire as in version 2, with `p_handoff`: a joining waiter's row carries
-- the lease it asks for (`p_token` and the claim), so a release can grant it;
-- a queued claim whose lease was granted so (its sidecar did not hear of it)
-- gets that lease.
CREATE FUNCTION {s}.acquire(
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
    v_turn   boolean;
    v_lease  {s}.leases%ROWTYPE;
    v_seq    bigint;
    v_pos    bigint;
    v_retry  timestamptz;
    v_cap    timestamptz;
    v_result json;
    v_token  text := CASE WHEN p_handoff THEN p_token END;
BEGIN
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

    -- Waiters of sidecars that stopped heartbeating leave the queue.
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

    <<decide>>
    BEGIN
        -- Handed over while its sidecar did not hear of it.
        IF p_turn = 'queued' AND p_handoff THEN
            SELECT * INTO v_lease FROM {s}.leases
             WHERE token = p_token AND kind = p_kind AND name = p_name;
            IF FOUND THEN
                DELETE FROM {s}.waiters WHERE seq = p_seq;
                v_result := {s}.granted(v_lease, v_now);
                EXIT decide;
            END IF;
        END IF;

        -- A ticket removed while its sidecar could not heartbeat takes its place back.
        IF p_turn = 'queued' AND NOT EXISTS (SELECT 1 FROM {s}.waiters WHERE seq = p_seq) THEN
            INSERT INTO {s}.waiters (seq, kind, name, owner, sidecar, instance, mode, queued_at,
                                     token, ttl_ms, max_hold_ms, lock_delay_ms)
            VALUES (p_seq, p_kind, p_name, p_owner, p_sidecar, p_instance, p_mode, v_now,
                    v_token, p_ttl_ms, p_max_hold_ms, p_lock_delay_ms);
        END IF;

        SELECT count(*) INTO v_live FROM {s}.leases WHERE kind = p_kind AND name = p_name;
        SELECT count(*) INTO v_queue FROM {s}.waiters WHERE kind = p_kind AND name = p_name;

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
                    DELETE FROM {s}.waiters WHERE seq = p_seq;
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
             WHERE kind = p_kind AND name = p_name AND seq < p_seq;
            v_turn := CASE
                WHEN p_kind = 'semaphore' THEN v_ahead < k.permits - v_live
                WHEN p_mode = 'exclusive' THEN v_ahead = 0
                ELSE NOT EXISTS (SELECT 1 FROM {s}.waiters
                                 WHERE kind = p_kind AND name = p_name AND seq < p_seq
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
                DELETE FROM {s}.waiters WHERE seq = p_seq;
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

-- Version 2's acquire, for sidecars of versions 1 to 3: their waiters carry
-- no lease, and are woken rather than handed one.
CREATE OR REPLACE FUNCTION {s}.acquire(
    p_kind text, p_name text, p_mode text, p_owner text, p_sidecar text, p_instance text,
    p_token text, p_ttl_ms bigint, p_limit integer, p_lock_delay_ms bigint,
    p_max_hold_ms bigint, p_turn text, p_seq bigint, p_lapse_ms bigint)
RETURNS json
LANGUAGE sql VOLATILE
AS $$
    SELECT {s}.acquire(p_kind, p_name, p_mode, p_owner, p_sidecar, p_instance, p_token,
                       p_ttl_ms, p_limit, p_lock_delay_ms, p_max_hold_ms, p_turn, p_seq,
                       p_lapse_ms, false)
$$;

-- Release: drops one hold of a live lease; the last one deletes the row and
-- passes the lock on (pass_on). NULL: the token holds nothing. Takes the
-- key's row lock first, as acquire does, so that a release and an acquire
-- of one key never both decide.
CREATE FUNCTION {s}.release(p_kind text, p_name text, p_token text, p_lapse_ms bigint)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_count integer;
    v_expires timestamptz;
    v_now timestamptz;
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
    IF EXISTS (SELECT 1 FROM {s}.leases
                WHERE kind = p_kind AND name = p_name AND expires_at > v_now) THEN
        PERFORM {s}.wake(p_kind, p_name);
    ELSE
        PERFORM {s}.pass_on(p_kind, p_name, v_now, p_lapse_ms);
    END IF;
    RETURN 0;
END
$fn$;

-- Version 1's release, for older sidecars: the same, with version 1's lapse
-- (10 s).
CREATE OR REPLACE FUNCTION {s}.release(p_kind text, p_name text, p_token text)
RETURNS integer
LANGUAGE sql VOLATILE
AS $$ SELECT {s}.release(p_kind, p_name, p_token, 10000) $$;

-- Leaves the queue (timeout, disconnect); a ticket the lock was handed to
-- meanwhile (its waiter gone before it heard) releases that lease, passing
-- the lock on. Whether anything was left or released.
CREATE FUNCTION {s}.dequeue(p_seq bigint, p_token text, p_lapse_ms bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_kind text;
    v_name text;
BEGIN
    DELETE FROM {s}.waiters WHERE seq = p_seq RETURNING kind, name INTO v_kind, v_name;
    IF FOUND THEN
        PERFORM {s}.wake(v_kind, v_name);
        RETURN true;
    END IF;
    SELECT kind, name INTO v_kind, v_name FROM {s}.leases WHERE token = p_token;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    RETURN {s}.release(v_kind, v_name, p_token, p_lapse_ms) IS NOT NULL;
END
$fn$;
