-- ARGV: 1 kind, 2 token.
-- Returns {now, expires} while held, {now, -1} when gone, {now, -2} when a
-- force-release removed it.
clock()
local token = ARGV[2]
if IS_LOCK then
  local x = xlease()
  if x and x.token == token then return {NOW, x.e} end
end
prune()
local m = meta_of(token)
if not m or (IS_LOCK and m.m ~= "s") then
  tidy_if_idle()
  if redis.pcall("HEXISTS", FORCED, token) == 1 then return {NOW, -2} end
  return {NOW, -1}
end
return {NOW, m.e}
