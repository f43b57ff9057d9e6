-- ARGV: 1 kind, 2 channel, 3 index member, 4 heartbeat ms, 5 sidecar.
-- Keeps this sidecar's waiters on the lock alive, however many there are.
clock()
if redis.call("ZCARD", QUEUE) > 0 then
  put_beat(ARGV[5], NOW + tonumber(ARGV[4]))
  set_expiries()
end
return 1
