-- ARGV: 1 kind.
-- Removes every lease (lock-delay from now) and returns their tokens. Each
-- token is noted in {<main>}:forced until a minute past its lease's
-- expiry, so that its holder's sidecar, finding the lease gone (through
-- whichever sidecar this ran), can tell a force-release (status.lua).
clock()
prune()
local tokens = {}
local delay = 0
local last = 0
local x = IS_LOCK and xlease()
if x then
  tokens[#tokens + 1] = x.token
  delay = x.dl
  last = x.e
  main_del()
end
local h, keys = holders()
local shared = {}
for _, token in ipairs(keys) do
  if not IS_LOCK or h[token].m == "s" then shared[#shared + 1] = token end
end
for _, token in ipairs(shared) do
  tokens[#tokens + 1] = token
  delay = math.max(delay, h[token].dl)
  last = math.max(last, h[token].e)
  drop_shared(token)
end
sync_shared()
delay_until(NOW + delay)
tidy_if_idle()
if #tokens > 0 then
  -- Not over a key of another type (written by hand), which stays as it is.
  local found = redis.call("TYPE", FORCED).ok
  if found == "hash" or found == "none" then
    local keep = last - NOW + 60000
    for _, token in ipairs(tokens) do redis.call("HSET", FORCED, token, "1") end
    if redis.call("PTTL", FORCED) < keep then redis.call("PEXPIRE", FORCED, keep) end
  end
  redis.call("PUBLISH", TAG .. "wake", "f")
end
return tokens
