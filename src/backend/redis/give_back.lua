-- ARGV: 1 kind, 2 fence, 3 how the lock passes to the next claim in line
-- (hand_over()'s mode), 4 this sidecar's process (instance), 5 the stem of
-- sidecars' own channels.
-- Gives back a lease a release handed to this process for a claim it does
-- not know (its join's answer was lost): if the main key still holds that
-- lease (its fence) and nobody re-entered it, the lock passes on.
-- Returns 1 when it was given back.
clock()
local x = IS_LOCK and xlease()
if x and x.f == tonumber(ARGV[2]) and x.c == 1 then
  if not hand_over(ARGV[3], ARGV[4], ARGV[5]) then main_del() end
  return 1
end
return 0
