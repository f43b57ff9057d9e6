-- ARGV: 1 kind, 2 channel, 3 index member, 4 ticket seq.
local seq = ARGV[4]
local was_head = redis.call("ZRANK", QUEUE, seq) == 0
local removed = redis.call("ZREM", QUEUE, seq)
redis.call("HDEL", WAITERS, seq)
tidy_if_idle()
if removed == 1 and was_head then redis.call("PUBLISH", CHANNEL, "d") end
return removed
