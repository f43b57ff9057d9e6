-- ARGV: 1 kind, 2 this sidecar's process (instance), 3.. its live ticket seqs.
-- After failed calls (a dequeue that never arrived, a join whose reply was
-- lost), drops this sidecar's queued tickets that it no longer waits on.
local live = {}
for i = 3, #ARGV do live[ARGV[i]] = true end
local removed = 0
for _, e in ipairs(queue()) do
  if e.inst == ARGV[2] and not live[e.seq] then
    redis.call("LREM", QUEUE, 1, e.raw)
    removed = removed + 1
  end
end
tidy_if_idle()
if removed > 0 then redis.call("PUBLISH", TAG .. "wake", "c") end
return removed
