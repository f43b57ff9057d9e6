-- The common cases of an exclusive lock, before the prelude: a free lock
-- nobody waits for is granted (the main key takes the lease, the fence
-- counter moves: 4 commands inside the script); a claim on a lock another
-- owner holds joins the queue's tail (3) or, trying once, is told who holds
-- it (2), and so is one on a free lock that claims are queued for (5,
-- also trying once, which reads the clock); a queued claim whose turn came
-- (the lock free, it first in line, or anywhere in line without FIFO) is
-- granted, and one the lock was handed
-- to already (its message missed) gets that grant. Everything else — shared
-- and semaphore claims, re-entry, foreign holders and markers, lock-delay,
-- the first join of a sidecar (its heartbeat), keys written by hand — goes
-- on to the full script, with nothing written here.
-- ARGV as in acquire.lua.
do
  if IS_LOCK and ARGV[3] == "x" then
    local turn, token, spec = ARGV[2], ARGV[4], ARGV[5]
    -- The fence of a grant, granted below (not by a closure: creating one
    -- costs every call).
    local granted
    local v = redis.pcall("GET", MAIN)
    if turn ~= "q" then
      if v == false then
        -- Free, unless claims wait, or shared leases (expired ones too,
        -- whose lock-delay the full script starts) or a delay are about.
        -- Without FIFO (Redlock, where each handoff leaves every node's
        -- lock free with claims queued until the head takes it), one look
        -- tells whether claims alone are about: EXISTS counts a key named
        -- twice twice, so 1 is the queue alone. With FIFO that state is
        -- rare, and the free lock's grant is spared the two names.
        local fifo = (ARGV[14] or "1") == "1"
        local about
        if fifo then
          about = redis.call("EXISTS", TAG .. "q", TAG .. "expiry", TAG .. "delay")
        else
          about = redis.call("EXISTS", TAG .. "q", TAG .. "expiry", TAG .. "expiry",
            TAG .. "delay", TAG .. "delay")
        end
        if about == 0 then
          local fence = redis.pcall("INCR", TAG .. "fence")
          if type(fence) == "number" then
            -- (A counter written by hand, signed or past exact: the full
            -- script reports it.)
            if fence >= 1 and fence <= LAST_EXACT then
              granted = fence
            else
              redis.call("DECR", TAG .. "fence")
            end
          end
        elseif (turn == "o" or (ARGV[12] or "0") == "0")
            and (fifo and redis.call("EXISTS", TAG .. "expiry", TAG .. "delay") == 0
                 or not fifo and about == 1) then
          -- Free, and only claims wait: behind them. Retry when the first
          -- of their processes' heartbeats lapses (a dead process's claims
          -- hold the queue until then), as the full script's first_lapse().
          local beats = redis.pcall("HGETALL", TAG .. "heartbeat")
          if type(beats) == "table" and beats.err == nil then
            local first = 0
            for i = 2, #beats, 2 do
              local d = tonumber(beats[i])
              if d and (first == 0 or d < first) then first = d end
            end
            local retry = first > 0 and first + 1 or 0
            if turn == "o" then
              -- Unless a process's beat lapsed (or none is kept): the full
              -- script prunes its claims, and may grant this one. (A join
              -- is told to look again then, and its look prunes.)
              if first > 0 and first > clock() then
                local n = redis.pcall("LLEN", TAG .. "q")
                if type(n) == "number" then return {0, 0, {}, n, 0, retry, 0} end
              end
            else
              local seq = redis.pcall("INCR", TAG .. "seq")
              if type(seq) == "number" and (seq < 1 or seq > LAST_EXACT) then
                redis.call("DECR", TAG .. "seq")
                seq = nil
              end
              if type(seq) == "number" then
                local n = redis.pcall("RPUSH", TAG .. "q",
                  string.format("%d x %s %s %s %s", seq, token, ARGV[11] or "0", ARGV[9], spec))
                if type(n) == "number" then return {0, 0, {}, n, n, retry, seq} end
              end
            end
          end
        end
      else
        local l = lease_of(v)
        if l and string.sub(l.who, 1, #ARGV[8]) ~= ARGV[8] then
          -- Without the clock: the lease's expiry, and its lock-delay for
          -- when it has passed (the caller's clock tells).
          local holder = {l.who, "x", l.f, l.c, l.t0, l.e}
          if turn == "o" then
            local n = redis.pcall("LLEN", TAG .. "q")
            if type(n) == "number" then return {0, 0, {holder}, n, 0, l.e, 0, l.dl} end
          elseif (ARGV[12] or "0") == "0" then
            local seq = redis.pcall("INCR", TAG .. "seq")
            if type(seq) == "number" and (seq < 1 or seq > LAST_EXACT) then
              redis.call("DECR", TAG .. "seq")
              seq = nil
            end
            if type(seq) == "number" then
              local n = redis.pcall("RPUSH", TAG .. "q",
                string.format("%d x %s %s %s %s", seq, token, ARGV[11] or "0", ARGV[9], spec))
              if type(n) == "number" then
                -- A queue this join started expires unless heartbeats keep it.
                if n == 1 then redis.call("PEXPIRE", TAG .. "q", HEARTBEAT_TTL) end
                return {0, 0, {holder}, n, n, l.e, seq, l.dl}
              end
            end
          end
        end
      end
    else
      local l = lease_of(v)
      if l and l.token == token and l.e > clock() then
        -- Handed over while its sidecar did not hear of it.
        return {1, NOW, token, l.f, l.c, l.t0, l.e}
      elseif l and string.sub(l.who, 1, #ARGV[8]) ~= ARGV[8] then
        -- Another owner holds it: still queued (else passed by, and the
        -- full script queues it again at its place).
        local at = redis.pcall("LPOS", TAG .. "q", ARGV[10] or "")
        if type(at) == "number" then
          return {0, 0, {{l.who, "x", l.f, l.c, l.t0, l.e}}, redis.call("LLEN", TAG .. "q"),
                  at + 1, l.e, 0, l.dl}
        end
      elseif v == false then
        local Q = TAG .. "q"
        local entry = ARGV[10] or ""
        local first = (ARGV[14] or "1") ~= "1" or redis.pcall("LINDEX", Q, 0) == entry
        if first and redis.call("EXISTS", TAG .. "expiry", TAG .. "delay") == 0 then
          local fence = redis.pcall("INCR", TAG .. "fence")
          if type(fence) == "number" and (fence < 1 or fence > LAST_EXACT) then
            redis.call("DECR", TAG .. "fence")
            fence = nil
          end
          if type(fence) == "number" and redis.pcall("LREM", Q, 1, entry) == 1 then
            granted = fence
          end
        end
      end
    end
    if granted then
      -- The main key takes the new lease, and the reply is its value (whose
      -- since is now): one string costs Redis less than a table to answer.
      clock()
      local len, dl = ARGV[6], ARGV[7]
      local lease = string.format("%s %d %d %d 1 %s", token, granted, NOW, NOW + len, spec)
      -- PX as text: a number would be formatted by "%.17g".
      redis.call("SET", MAIN, lease, "PX", dl == "0" and len or string.format("%d", len + dl))
      return lease
    end
  end
end
