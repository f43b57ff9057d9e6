-- ARGV: 1 kind, 2 the queue entry (as the join wrote it), 3 its token, 4
-- how the lock passes to the next claim (hand_over()'s mode),
-- 5 this sidecar's process (instance), 6 the stem of sidecars' own channels
-- (see hand_over()).
-- Leaves the queue; a claim the lock was handed to meanwhile (its waiter
-- gone before it heard) is released, passing the lock on.
-- Returns 1 when the entry was queued, 2 when its grant was released, 0 else.
local entry, token = ARGV[2], ARGV[3]
local was_head = redis.call("LINDEX", QUEUE, 0) == entry
local removed = redis.call("LREM", QUEUE, 1, entry)
if removed == 0 and IS_LOCK then
  clock()
  local x = xlease()
  if x and x.token == token then
    -- Its owner may have re-entered it through another request meanwhile.
    x.c = x.c - 1
    if x.c > 0 then
      xlease_put(x)
    elseif not hand_over(ARGV[4], ARGV[5], ARGV[6]) then
      main_del()
    end
    return 2
  end
end
tidy_if_idle()
if removed == 1 and was_head then
  -- The next claim may get in: handed the lock if it is free, else woken.
  if IS_LOCK and not main_get() then prune() end
  if IS_LOCK and not main_get() and redis.call("EXISTS", EXPIRY, DELAY) == 0 then
    if not hand_over(ARGV[4], ARGV[5], ARGV[6]) then main_del() end
  else
    redis.call("PUBLISH", TAG .. "wake", "d")
  end
end
return removed
