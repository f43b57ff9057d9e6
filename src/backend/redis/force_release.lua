-- ARGV: 1 kind.
-- Removes every lease (lock-delay from now) and returns their tokens.
clock()
prune()
local tokens = {}
local delay = 0
local x = IS_LOCK and xlease()
if x then
  tokens[#tokens + 1] = x.token
  delay = x.dl
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
  drop_shared(token)
end
sync_shared()
delay_until(NOW + delay)
tidy_if_idle()
if #tokens > 0 then redis.call("PUBLISH", TAG .. "wake", "f") end
return tokens
