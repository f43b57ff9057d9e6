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
  -- pcall: a key of another type there (written by hand) must not stop
  -- the script after the leases went.
  local keep = last - NOW + 60000
  for _, token in ipairs(tokens) do redis.pcall("HSET", FORCED, token, "1") end
  local left = redis.pcall("PTTL", FORCED)
  if type(left) == "number" and left < keep then redis.pcall("PEXPIRE", FORCED, keep) end
  redis.call("PUBLISH", TAG .. "wake", "f")
end
return tokens
