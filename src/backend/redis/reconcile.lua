-- ARGV: 1 kind, 2 channel, 3 index member, 4 sidecar, 5.. its live ticket seqs.
-- After failed calls (a dequeue that never arrived, a join whose reply was
-- lost), drops this sidecar's queued tickets that it no longer waits on.
local live = {}
for i = 5, #ARGV do live[ARGV[i]] = true end
local removed = 0
for _, s in ipairs(redis.call("ZRANGE", QUEUE, 0, -1)) do
  local raw = redis.call("HGET", WAITERS, s)
  if raw and cjson.decode(raw).s == ARGV[4] and not live[s] then
    redis.call("ZREM", QUEUE, s)
    redis.call("HDEL", WAITERS, s)
    removed = removed + 1
  end
end
tidy_if_idle()
if removed > 0 then redis.call("PUBLISH", CHANNEL, "c") end
return removed
