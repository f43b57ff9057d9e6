-- Renewing an exclusive lease, before the prelude: its main key takes the
-- new expiry (3 commands inside the script). Anything else goes on to the full
-- script, with nothing written here.
-- ARGV as in renew.lua.
do
  if IS_LOCK then
    local token = ARGV[2]
    local v = redis.pcall("GET", MAIN)
    if type(v) == "string" then
      -- The lease's fields as text (lean.lua), kept as text where they are
      -- written back unchanged: only the times are read as numbers.
      local t, f, t0, e, c, spec, ttl, mh, dl =
        string.match(v, "^(%x+) (%d+) (%d+) (%d+) (%d+) ((%d+) (%d+) (%d+) .*)$")
      if t == token and e + 0 > clock() then
        local want = ARGV[3] + 0
        if want == 0 then want = ttl + 0 end
        local ends = NOW + want
        if mh + 0 > 0 and ends > t0 + mh then ends = t0 + mh end
        -- Never sooner than it ends now: a re-entry (through any sidecar)
        -- may have given it longer, and told its client so.
        if e + 0 > ends then ends = e + 0 end
        -- Past its max_hold, it ends now.
        local kept = math.max(ends, NOW + 1)
        redis.call("SET", MAIN, string.format("%s %s %s %d %s %s", t, f, t0, kept, c, spec),
          "PX", string.format("%d", kept - NOW + dl))
        return {NOW, ends}
      end
    end
  end
end
