-- ARGV: 1 kind, 2 channel, 3 index member, 4 token.
-- Returns {now, expires} while held, {now, -1} when gone.
clock()
inflate()
prune()
local m = meta_of(ARGV[4])
if not m then
  tidy_if_idle()
  return {NOW, -1}
end
return {NOW, m.e}
