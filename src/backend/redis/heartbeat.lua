-- ARGV: 1 kind, 2 heartbeat ms, 3 this sidecar's process (instance), 4 how
-- the lock passes to the next claim (hand_over()'s mode), 5 the stem of
-- sidecars' own channels (see hand_over()).
-- Keeps this process's waiters on the lock alive, however many there are.
-- A lock that is free while claims wait (its holder's lease ran out and
-- nobody's timer has fired yet, or a wake-up was missed) passes on here.
clock()
if redis.call("LLEN", QUEUE) > 0 then
  put_beat(ARGV[3], NOW + tonumber(ARGV[2]))
  set_expiries()
  if IS_LOCK and not main_get() then
    prune()
    local free = not main_get() and redis.call("EXISTS", EXPIRY, DELAY) == 0
    if free and not hand_over(ARGV[4], ARGV[3], ARGV[5]) then main_del() end
  end
end
return 1
