-- ARGV: 1 kind, 2 fence, 3 token of the lease granted with it.
-- Raises the fence counter to at least ARGV[2] (Redlock keeps the nodes'
-- counters together so that any majority knows the highest fence granted),
-- and the fence this node stored for the lease to ARGV[2]: each node
-- counted its own, and the lease's is the highest, which every later
-- answer of any majority (a re-entry, a listing) then shows.
local f = tonumber(ARGV[2])
-- As text: some Redis 7.2 releases formatted a Lua number such as 1e8 as
-- 1e+8, which INCR refuses.
if tonumber(redis.call("GET", FENCE) or "0") < f then
  redis.call("SET", FENCE, string.format("%d", f))
end
local token = ARGV[3]
local x = xlease()
if x and x.token == token then
  if x.f < f then
    x.f = f
    xlease_put(x)
  end
else
  -- A holder's fence is kept as text (exact above 2^53 in JSON).
  local m = meta_of(token)
  if m and tonumber(m.f) < f then
    m.f = string.format("%d", f)
    put_holder(token, m)
  end
end
return 1
