-- ARGV: 1 kind, 2 token.
-- Returns {now, expires} while held, {now, -1} when gone.
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
  return {NOW, -1}
end
return {NOW, m.e}
