-- sidelock PostgreSQL backend, schema version 6: a join costs the same
-- behind 10,000 waiters as behind none.
--
-- In version 5 every acquire counted the key's queue and scanned all of it
-- for waiters of sidecars that stopped heartbeating: twice the queue's
-- length in rows per join, so 10,000 joins on one name cost the database
-- 50 million row reads, one after another under the key's row lock, and a
-- burst of them outlasted the pool's wait (503). Now:
--
-- * `keys.queued` is the key's number of waiter rows, kept by triggers on
--   `waiters` (so every function, of every version, keeps it right);
-- * acquire looks for dead sidecars in `sidecars` (one row per process)
--   and removes their waiters by sidecar and key, and reads the whole queue
--   only when the queue alone would hold its claim back and the queue's
--   head has no live sidecar row (to pass by rows whose sidecar has none);
-- * waiter rows without their sidecar's row are kept rare: a join
--   re-creates its own if another sidecar removed it (it had stopped
--   heartbeating for a while), and a dead sidecar's row goes only once its
--   waiters have;
-- * a key's waiters are looked up by row comparisons on `waiters_key`
--   (`(kind, name) >= (…)`): with plain equalities, the generic plan a
--   session settles on after five calls walked the primary key through
--   every key's waiters;
-- * every function that removes waiter rows takes their key's row lock
--   first, as acquire and release do: the triggers update the key's row,
--   and taking the locks in one order (key, then waiters) keeps them free
--   of deadlocks.

ALTER TABLE {s}.keys ADD COLUMN queued bigint NOT NULL DEFAULT 0;

-- Rows in and out, one update per key and statement (a row trigger would
-- update one key's row once per row: a statement removing 10,000 waiters of
-- one key would walk ever longer chains of its own row versions).
CREATE FUNCTION {s}.count_joined() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    UPDATE {s}.keys k SET queued = k.queued + n.n
      FROM (SELECT kind, name, count(*) AS n FROM joined GROUP BY kind, name) n
     WHERE k.kind = n.kind AND k.name = n.name;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION {s}.count_left() RETURNS trigger
LANGUAGE plpgsql
AS $fn$
BEGIN
    UPDATE {s}.keys k SET queued = k.queued - n.n
      FROM (SELECT kind, name, count(*) AS n FROM left_queue GROUP BY kind, name) n
     WHERE k.kind = n.kind AND k.name = n.name;
    RETURN NULL;
END
$fn$;

-- The triggers first: creating them locks out every writer of `waiters`
-- until this migration commits, so the count below stays right.
CREATE TRIGGER waiters_joined AFTER INSERT ON {s}.waiters
    REFERENCING NEW TABLE AS joined
    FOR EACH STATEMENT EXECUTE FUNCTION {s}.count_joined();
CREATE TRIGGER waiters_left AFTER DELETE ON {s}.waiters
    REFERENCING OLD TABLE AS left_queue
    FOR EACH STATEMENT EXECUTE FUNCTION {s}.count_left();

UPDATE {s}.keys k SET queued = q.n
  FROM (SELECT kind, name, count(*) AS n FROM {s}.waiters GROUP BY kind, name) q
 WHERE k.kind = q.kind AND k.name = q.name;

-- A dead sidecar's waiters of one key, found without reading other keys'.
CREATE INDEX waiters_instance_key ON {s}.waiters (instance, kind, name);
DROP INDEX {s}.waiters_instance;

-- A sidecar about to insert a waiter row: its own row, if another sidecar
-- removed it (it had stopped heartbeating, and now works again).
CREATE FUNCTION {s}.present(p_instance text, p_sidecar text, p_now timestamptz) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM {s}.sidecars WHERE instance = p_instance) THEN
        INSERT INTO {s}.sidecars (instance, sidecar, started_at, heartbeat_at)
        VALUES (p_instance, p_sidecar, p_now, p_now)
        ON CONFLICT (instance) DO NOTHING;
    END IF;
END
$fn$;

-- Removes the waiter rows `p_seqs`, key by key, each under its key's row
-- lock, and wakes those keys' waiters. With `p_wait` false a key another
-- transaction has locked is skipped (its rows stay for the next call);
-- with `p_wait` true its lock is waited for, keys taken in order (every
-- other holder of a key's lock holds just that one, so no cycle forms).
-- The number of rows removed.
CREATE FUNCTION {s}.drop_waiters(p_seqs bigint[], p_wait boolean) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    r record;
    v_n bigint := 0;
    v_k bigint;
BEGIN
    FOR r IN SELECT DISTINCT kind, name FROM {s}.waiters
              WHERE seq = ANY (p_seqs) ORDER BY kind, name LOOP
        IF p_wait THEN
            PERFORM 1 FROM {s}.keys WHERE kind = r.kind AND name = r.name FOR NO KEY UPDATE;
        ELSE
            PERFORM 1 FROM {s}.keys WHERE kind = r.kind AND name = r.name
                FOR NO KEY UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
        END IF;
        DELETE FROM {s}.waiters WHERE seq = ANY (p_seqs) AND kind = r.kind AND name = r.name;
        GET DIAGNOSTICS v_k = ROW_COUNT;
        IF v_k > 0 THEN
            PERFORM {s}.wake(r.kind, r.name);
            v_n := v_n + v_k;
        END IF;
    END LOOP;
    RETURN v_n;
END
$fn$;

-- Acquire as in version 4 (its signature and answers), with the queue
-- length read from `keys.queued` and dead sidecars found in `sidecars`.
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


-- pass_on as in version 4, its head looked up through `waiters_key`.
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


-- Leaves the queue as in version 4, under the key's row lock.
CREATE OR REPLACE FUNCTION {s}.dequeue(p_seq bigint, p_token text, p_lapse_ms bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_kind text;
    v_name text;
BEGIN
    SELECT kind, name INTO v_kind, v_name FROM {s}.waiters WHERE seq = p_seq;
    IF FOUND THEN
        PERFORM 1 FROM {s}.keys WHERE kind = v_kind AND name = v_name FOR NO KEY UPDATE;
        DELETE FROM {s}.waiters WHERE seq = p_seq;
        IF FOUND THEN
            PERFORM {s}.wake(v_kind, v_name);
            RETURN true;
        END IF;
        -- Granted meanwhile by a release: its lease is looked up below.
    END IF;
    SELECT kind, name INTO v_kind, v_name FROM {s}.leases WHERE token = p_token;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    RETURN {s}.release(v_kind, v_name, p_token, p_lapse_ms) IS NOT NULL;
END
$fn$;

-- Version 1's dequeue, for older sidecars: their waiters carry no lease.
CREATE OR REPLACE FUNCTION {s}.dequeue(p_seq bigint) RETURNS boolean
LANGUAGE sql VOLATILE
AS $$ SELECT {s}.dequeue(p_seq, NULL, 0) $$;

-- The heartbeat as in version 1 (its signature and answer), removing
-- waiter rows under their keys' row locks: its own rows that no request
-- waits for wait for their keys (a skipped one could reach the head of the
-- queue and be handed the lock nobody hears of), a dead sidecar's are
-- skipped while their key is busy (acquire removes them too), and a dead
-- sidecar's row goes once its waiters have.
CREATE OR REPLACE FUNCTION {s}.heartbeat(p_instance text, p_sidecar text, p_lapse_ms bigint,
                                         p_live bigint[], p_gone bigint[], p_ghost_ms bigint)
RETURNS json
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
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
             WHERE kind = r.kind AND name = r.name;
            PERFORM {s}.wake(r.kind, r.name);
            v_leases := v_leases + v_n;
        END IF;
    END LOOP;

    RETURN json_build_object('now_ms', {s}.ms(v_now), 'ghosts', v_ghosts, 'waiters', v_waiters,
                             'leases', v_leases);
END
$fn$;

-- A sidecar shutting down: its waiters leave the queue, under their keys'
-- row locks, and then its row goes.
CREATE OR REPLACE FUNCTION {s}.leave(p_instance text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    PERFORM {s}.drop_waiters(
        ARRAY(SELECT seq FROM {s}.waiters WHERE instance = p_instance), true);
    DELETE FROM {s}.sidecars WHERE instance = p_instance;
END
$fn$;
