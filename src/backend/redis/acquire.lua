-- ARGV: 1 kind, 2 turn ("o" once, "j" join, "q" queued), 3 mode ("x"|"s"),
-- 4 token (the new lease's; a queued claim's was given when it joined),
-- 5 SPEC "<ttl> <max_hold> <lock_delay> <[owner, sidecar] as JSON>" (see
-- lean.lua), 6 the lease's span ms (ttl, or max_hold when shorter), 7
-- lock_delay ms, 8 the owner as the JSON array starts ('["<owner>",'), 9
-- the sidecar as JSON writes it (no quotes), 10 a queued claim's entry (as
-- its join wrote it), 11 since ms of a joining claim's entry (the sidecar's
-- reading of the server clock: it keeps the entry to find it later), 12 heartbeat ms when this join must
-- write the sidecar's heartbeat ("0": its heartbeat is kept already), 13
-- limit (0: none), 14 fifo ("1": grants follow the queue; "0": newcomers
-- still wait behind the queue, but queued claims are not ordered among
-- themselves, as in Redlock, where each node may see joins in another
-- order), 15 most permits a semaphore may have (0: any; Redlock: 1), 16
-- "1" when a queued claim's attempt runs again after its connection broke.
-- Arguments 10 to 16 may be left out from the end where they hold their
-- defaults ("", "0", "0", "0", "1", "0", "0"): each costs Redis about 900
-- instructions to pass, and a try-once claim on Redis needs none of them.
-- Returns {1, now, token, fence, count, since, expires} when granted (the
-- fast path's grant answers the main key's new value instead, whose since
-- is now), {0, now, holders, queue_length, position, retry_at, seq} when
-- busy (holders as holder_rows() writes them; now is 0 when the fast path did
-- not read the clock), {2, now, active_limit} on a limit mismatch, {3, now}
-- when limit is required, {4, now, limit} when the limit is above the most
-- permits allowed, {5, now, key, found} when a key it would write holds
-- something else (see misfit()), {6, now} when a queued claim run again is
-- no longer queued or would re-enter; nothing is written then.
local turn, mode, token, spec = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local len, lock_delay, owner_prefix, inst = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[9]
local entry, since = ARGV[10] or "", ARGV[11] or "0"
local beat, asked = tonumber(ARGV[12] or "0"), tonumber(ARGV[13] or "0")
local fifo = (ARGV[14] or "1") == "1"
local most = tonumber(ARGV[15] or "0")
local again = (ARGV[16] or "0") == "1"
clock()

local bad, found = misfit(true)
if bad then return {5, NOW, bad, found} end

prune()
local was_idle = idle()

local limit = 0
if not IS_LOCK then
  local active = tonumber(redis.call("GET", LIMIT) or "0")
  local unset = false
  if active > 0 and not was_idle then
    if asked > 0 and asked ~= active then return {2, NOW, active} end
    limit = active
  elseif asked == 0 and turn == "q" then
    -- Queued without a limit (it took the one in force), its place dropped
    -- while its sidecar could not heartbeat and the semaphore idle since:
    -- the limit still there is the one it queued under; gone with the
    -- place (or the place put back, and no limit in force), one permit is
    -- within any limit, so it may take one when none is held, and leaves
    -- the limit to the next claim that gives one.
    limit = active
    if limit == 0 then limit, unset = 1, true end
  else
    if asked == 0 then return {3, NOW} end
    limit = asked
  end
  -- Before the limit or anything else is written.
  if most > 0 and limit > most then return {4, NOW, limit} end
  if limit ~= active and not unset then redis.call("SET", LIMIT, string.format("%d", limit)) end
end

local function leave_queue()
  if turn == "q" then redis.call("LREM", QUEUE, 1, entry) end
end

local function cap(e, m)
  if m.cap > 0 and e > m.cap then return m.cap end
  return e
end

local x = IS_LOCK and xlease()

-- Handed over while its sidecar did not hear of it: that grant.
if x and turn == "q" and x.token == token then
  return {1, NOW, token, x.f, x.c, x.t0, x.e}
end

-- Granted by an earlier run of this same attempt, whose answer was lost (the
-- sidecar runs a queued attempt again when its connection broke): that
-- grant as it stands, not a re-entry or a second place in the queue.
if turn == "q" and not (IS_LOCK and mode == "x") then
  local m = meta_of(token)
  if m then return {1, NOW, token, m.f, m.c, m.t0, m.e} end
end

-- Run again, a claim no longer queued was served by the first run — a
-- re-entry, whose lease has another token — or dropped as its sidecar's:
-- which, nobody can tell here, and a re-entry must not count twice.
if turn == "q" and again and not redis.call("LPOS", QUEUE, entry) then return {6, NOW} end

-- Re-entry: the same owner asking again in the mode it holds. Never on a
-- run again: the first run may have re-entered already, and a rejoin (a
-- `p`, a pub/sub reconnect) may have queued the claim again since.
if IS_LOCK then
  local function mine(who) return string.sub(who, 1, #owner_prefix) == owner_prefix end
  if mode == "x" and x and mine(x.who) then
    if again then return {6, NOW} end
    x.c = x.c + 1
    x.e = cap(math.max(x.e, NOW + tonumber(string.match(spec, "^%d+"))), x)
    xlease_put(x)
    leave_queue()
    return {1, NOW, x.token, x.f, x.c, x.t0, x.e}
  end
  if mode == "s" then
    local h, keys = holders()
    for _, held in ipairs(keys) do
      local m = h[held]
      -- The decoded owners: cjson would encode `/` as `\/` again.
      if m.m == "s" and m.o == cjson.decode(string.sub(owner_prefix, 2, -2)) then
        if again then return {6, NOW} end
        m.c = m.c + 1
        m.e = cap(math.max(m.e, NOW + tonumber(string.match(spec, "^%d+"))), m)
        put_holder(held, m)
        redis.call("ZADD", EXPIRY, m.e, held)
        sync_shared()
        leave_queue()
        set_expiries()
        return {1, NOW, held, m.f, m.c, m.t0, m.e}
      end
    end
  end
end

-- Room: nothing in the way but the queue.
local room
local delayed = 0
if not IS_LOCK then
  delayed = delay_end()
  room = delayed == 0 and redis.call("ZCARD", EXPIRY) < limit
else
  local main = main_get()
  if mode == "x" then
    room = not main
    -- A delay older sidecars kept in the delay key holds too.
    delayed = delay_end()
    if delayed > 0 then room = false end
  else
    room = (not main) or main == SHARED
    if main == SHARED then delayed = delay_end() end
    if delayed > 0 then room = false end
  end
  if main == DELAYED then delayed = NOW + redis.call("PTTL", MAIN) end
  local _, x_delay = xlease()
  if x_delay > 0 then delayed = x_delay end
end

local position = 0
local turn_ok
if turn == "q" then
  local rank = redis.call("LPOS", QUEUE, entry)
  if not rank then
    -- Pruned while this sidecar could not heartbeat: rejoin at its place.
    local seq = tonumber(string.match(entry, "^%d+"))
    local before = nil
    for _, e in ipairs(queue()) do
      if tonumber(e.seq) > seq then before = e.raw break end
    end
    if before then
      redis.call("LINSERT", QUEUE, "BEFORE", before, entry)
    else
      redis.call("RPUSH", QUEUE, entry)
    end
    put_beat(inst, NOW + beat)
    rank = redis.call("LPOS", QUEUE, entry)
  end
  position = rank + 1
  if not IS_LOCK then
    turn_ok = rank < limit - redis.call("ZCARD", EXPIRY)
  elseif mode == "x" then
    turn_ok = rank == 0
  else
    turn_ok = true
    if rank > 0 then
      for _, s in ipairs(redis.call("LRANGE", QUEUE, 0, rank - 1)) do
        local e = entry_of(s)
        if not e or e.m ~= "s" then turn_ok = false break end
      end
    end
  end
else
  turn_ok = redis.call("LLEN", QUEUE) == 0
end
if not fifo and turn == "q" then turn_ok = true end

if room and turn_ok then
  local fence = redis.call("INCR", FENCE)
  if IS_LOCK and mode == "x" then
    xlease_put({token = token, f = fence, t0 = NOW, c = 1, spec = spec, e = NOW + len,
                dl = lock_delay, who = string.match(spec, "^%d+ %d+ %d+ (.*)$")})
  else
    local o, s = unpack(cjson.decode(string.match(spec, "^%d+ %d+ %d+ (.*)$")))
    local ttl, mh = string.match(spec, "^(%d+) (%d+) ")
    -- The fence as text: cjson writes numbers with 14 digits, and a fence
    -- counter set by hand can be longer.
    local m = {o = o, s = s, m = mode, f = string.format("%d", fence), c = 1, t0 = NOW,
               ttl = tonumber(ttl), cap = 0,
               dl = lock_delay, e = NOW + len}
    if tonumber(mh) > 0 then m.cap = NOW + tonumber(mh) end
    put_holder(token, m)
    redis.call("ZADD", EXPIRY, m.e, token)
    sync_shared()
  end
  leave_queue()
  set_expiries()
  return {1, NOW, token, fence, 1, NOW, NOW + len}
end

-- Busy: when can the blocking state lapse by itself?
local retry = 0
if delayed > 0 then
  retry = delayed
elseif not room then
  local first = redis.call("ZRANGE", EXPIRY, 0, 0, "WITHSCORES")
  if #first > 0 then retry = tonumber(first[2]) end
  if IS_LOCK then
    local held = xlease()
    local main = main_get()
    if held then
      retry = held.e
    elseif main and main ~= SHARED then
      local pttl = redis.call("PTTL", MAIN)
      if pttl > 0 then retry = NOW + pttl else retry = 0 end
    end
  end
end

-- Blocked by the queue: a waiter ahead whose sidecar died lapses at its
-- heartbeat deadline, which nobody would otherwise notice.
if not turn_ok then
  local lapse = first_lapse()
  if lapse > 0 then
    lapse = lapse + 1
    if retry == 0 or lapse < retry then retry = lapse end
  end
end

local ticket = 0
if turn == "j" then
  ticket = redis.call("INCR", SEQ)
  position = redis.call("RPUSH", QUEUE,
    string.format("%d %s %s %s %s %s", ticket, mode, token, since, inst, spec))
  -- A queue this join started expires unless heartbeats keep it (its
  -- process may beat here already, and not write a beat now; one that
  -- writes its beat sets the expiry from it).
  if position == 1 and beat == 0 then redis.call("PEXPIRE", QUEUE, HEARTBEAT_TTL) end
  if beat > 0 then put_beat(inst, NOW + beat) end
end
-- A claim put back at its place wrote its beat too.
set_expiries()
return {0, NOW, holder_rows(), redis.call("LLEN", QUEUE), position, retry, ticket}
