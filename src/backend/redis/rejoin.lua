-- ARGV: 1 kind, 2 this sidecar's process (instance), 3 heartbeat ms, 4.. the
-- entries of its waiters on the lock, as their joins wrote them.
-- Puts back, each at its place (by ticket), the entries of this process that
-- are no longer queued though it still waits on them: a release passed them
-- by while the process's pub/sub connection was down or its heartbeat late.
-- An entry the lock was handed to meanwhile, or that was granted a read
-- lease or a permit (its answer still on its way), is not one of them.
-- Returns the entries that went back.
clock()
local x = IS_LOCK and xlease()
local present = {}
local queued = {}
for _, s in ipairs(redis.call("LRANGE", QUEUE, 0, -1)) do
  present[s] = true
  local e = entry_of(s)
  if e then queued[#queued + 1] = e end
end
local back = {}
for i = 4, #ARGV do
  local e = entry_of(ARGV[i])
  if e and not present[ARGV[i]] and not (x and x.token == e.token) and not meta_of(e.token) then
    local before = nil
    for _, q in ipairs(queued) do
      if tonumber(q.seq) > tonumber(e.seq) then before = q.raw break end
    end
    if before then
      redis.call("LINSERT", QUEUE, "BEFORE", before, e.raw)
    else
      redis.call("RPUSH", QUEUE, e.raw)
    end
    back[#back + 1] = e.raw
  end
end
if #back > 0 then
  put_beat(ARGV[2], NOW + tonumber(ARGV[3]))
  set_expiries()
end
return back
