-- ARGV: 1 kind, 2 fence, 3 how the lock passes to the next claim in line
-- (hand_over()'s mode), 4 this sidecar's process (instance), 5 the stem of
-- sidecars' own channels, 6… tokens left to their own clean-up.
-- Gives back a lease a release handed to this process for a claim it does
-- not know (its join's answer was lost): if the main key still holds that
-- lease (its fence) and nobody re-entered it, the lock passes on — unless
-- it is one of the tokens of ARGV 6…, lost joins whose background release
-- takes (or took) the lost grant's hold: given back too, it would lose a
-- hold taken again by re-entering.
-- Returns 1 when it was given back, 2 when it is left to its release.
clock()
local x = IS_LOCK and xlease()
if x and x.f == tonumber(ARGV[2]) then
  for i = 6, #ARGV do
    if x.token == ARGV[i] then return 2 end
  end
  if x.c == 1 then
    if not hand_over(ARGV[3], ARGV[4], ARGV[5]) then main_del() end
    return 1
  end
end
return 0
