-- ARGV: 1 kind, 2 fence.
-- Raises the fence counter to at least ARGV[2] (Redlock keeps the nodes'
-- counters together so that any majority knows the highest fence granted).
local f = tonumber(ARGV[2])
if tonumber(redis.call("GET", FENCE) or "0") < f then redis.call("SET", FENCE, f) end
return 1
