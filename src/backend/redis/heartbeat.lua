-- ARGV: 1 kind, 2 channel, 3 index member, 4 heartbeat ms, 5.. ticket seqs.
-- Extends this sidecar's waiters' heartbeat deadlines (only those still queued).
local deadline = NOW + tonumber(ARGV[4])
for i = 5, #ARGV do
  redis.call("ZADD", BEAT, "XX", deadline, ARGV[i])
end
return 1
