-- ARGV: 1 kind, 2 channel, 3 index member, 4 turn ("once"|"join"|"queued"),
-- 5 ticket seq, 6 new token, 7 owner, 8 sidecar, 9 mode ("x"|"s"),
-- 10 ttl ms, 11 max_hold ms (0: none), 12 lock_delay ms, 13 limit (0: none),
-- 14 heartbeat ms, 15 fifo ("1": grants follow the queue; "0": newcomers
-- still wait behind the queue, but queued claims are not ordered among
-- themselves, as in Redlock, where each node may see joins in another order),
-- 16 most permits a semaphore may have (0: any; Redlock: 1), 17 [owner,
-- sidecar] as JSON, for the short form (acquire_fast.lua).
-- Returns {1, now, token, fence, count, since, expires} when granted,
-- {0, now, holders_json, queue_length, position, retry_at, seq} when busy,
-- {2, now, active_limit} on a limit mismatch, {3, now} when limit is required,
-- {4, now, limit} when the limit is above the most permits allowed,
-- {5, now, key, found} when a key it would write holds something else (see
-- misfit()); nothing is written then.
local turn, seq, token, owner, sidecar, mode = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local ttl, max_hold, lock_delay, asked, beat =
  tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local fifo = ARGV[15] == "1"
local most = tonumber(ARGV[16] or "0")
clock()
inflate()

local bad, found = misfit()
if bad then return {5, NOW, bad, found} end

prune()
local was_idle = idle()

local limit = 0
if not IS_LOCK then
  local active = tonumber(redis.call("GET", LIMIT) or "0")
  if active > 0 and not was_idle then
    if asked > 0 and asked ~= active then return {2, NOW, active} end
    limit = active
  else
    if asked == 0 then return {3, NOW} end
    limit = asked
  end
  -- Before the limit or anything else is written.
  if most > 0 and limit > most then return {4, NOW, limit} end
  if limit ~= active then redis.call("SET", LIMIT, limit) end
end

local function leave_queue()
  if turn == "queued" then
    redis.call("ZREM", QUEUE, seq)
    redis.call("HDEL", WAITERS, seq)
  end
end

local function cap(e, m)
  if m.cap > 0 and e > m.cap then return m.cap end
  return e
end

-- Re-entry: the same owner asking again in the mode it holds.
if IS_LOCK then
  local h, keys = holders()
  for _, held in ipairs(keys) do
    local m = h[held]
    if m.o == owner and m.m == mode then
      m.c = m.c + 1
      m.e = cap(math.max(m.e, NOW + ttl), m)
      put_holder(held, m)
      redis.call("ZADD", EXPIRY, m.e, held)
      if mode == "x" then
        redis.call("PEXPIRE", MAIN, m.e - NOW)
      else
        sync_shared()
      end
      leave_queue()
      set_expiries()
      return {1, NOW, held, m.f, m.c, m.t0, m.e}
    end
  end
end

local delayed = redis.call("PTTL", DELAY)
local room
if not IS_LOCK then
  room = redis.call("ZCARD", EXPIRY) < limit
elseif mode == "x" then
  room = not main_get()
else
  local main = main_get()
  room = (not main) or main == SHARED
end

local position = 0
local turn_ok
if turn == "queued" then
  local rank = redis.call("ZRANK", QUEUE, seq)
  if not rank then
    -- Pruned while this sidecar could not heartbeat: rejoin at the same place.
    local w = {o = owner, s = sidecar, m = mode, t0 = NOW}
    redis.call("ZADD", QUEUE, tonumber(seq), seq)
    redis.call("HSET", WAITERS, seq, cjson.encode(w))
    put_beat(sidecar, NOW + beat)
    rank = redis.call("ZRANK", QUEUE, seq)
  end
  position = rank + 1
  if not IS_LOCK then
    turn_ok = rank < limit - redis.call("ZCARD", EXPIRY)
  elseif mode == "x" then
    turn_ok = rank == 0
  else
    turn_ok = true
    if rank > 0 then
      for _, s in ipairs(redis.call("ZRANGE", QUEUE, 0, rank - 1)) do
        local w = cjson.decode(redis.call("HGET", WAITERS, s) or '{"m":"x"}')
        if w.m ~= "s" then turn_ok = false break end
      end
    end
  end
else
  turn_ok = redis.call("ZCARD", QUEUE) == 0
end
if not fifo and turn == "queued" then turn_ok = true end

if delayed <= 0 and room and turn_ok then
  local fence = redis.call("INCR", FENCE)
  local m = {o = owner, s = sidecar, m = mode, f = fence, c = 1, t0 = NOW,
             ttl = ttl, cap = 0, dl = lock_delay}
  if max_hold > 0 then m.cap = NOW + max_hold end
  m.e = cap(NOW + ttl, m)
  put_holder(token, m)
  redis.call("ZADD", EXPIRY, m.e, token)
  if IS_LOCK then
    if mode == "x" then
      main_set(token, m.e - NOW)
    else
      sync_shared()
    end
  end
  leave_queue()
  set_expiries()
  if was_idle and INDEX ~= "" then redis.call("ZADD", INDEX, 0, ARGV[3]) end
  return {1, NOW, token, fence, 1, NOW, m.e}
end

-- Busy: when can the blocking state lapse by itself?
local retry = 0
if delayed > 0 then
  retry = NOW + delayed
elseif not room then
  local first = redis.call("ZRANGE", EXPIRY, 0, 0, "WITHSCORES")
  if #first > 0 then retry = tonumber(first[2]) end
  if IS_LOCK then
    local main = main_get()
    if main and main ~= SHARED and not holders()[main] then
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
if turn == "join" then
  ticket = redis.call("INCR", SEQ)
  local w = {o = owner, s = sidecar, m = mode, t0 = NOW}
  redis.call("ZADD", QUEUE, ticket, ticket)
  redis.call("HSET", WAITERS, ticket, cjson.encode(w))
  put_beat(sidecar, NOW + beat)
  position = redis.call("ZCARD", QUEUE)
  set_expiries()
  if was_idle and INDEX ~= "" then redis.call("ZADD", INDEX, 0, ARGV[3]) end
end
return {0, NOW, holders_json(), redis.call("ZCARD", QUEUE), position, retry, ticket}
