-- The release's fast path when someone waits (release_fast.lua, which took
-- the head of the queue, or read it where the head only wakes): the lock
-- passes on from that entry, as
-- hand_over() does from the queue's head. Answers 0 (no holds left), or the
-- grant kept for the caller: a number or a string costs Redis less than a
-- table to answer.
if RELEASE_HEAD then
  if not hand_over(ARGV[3], ARGV[4], ARGV[5], true, RELEASE_HEAD, RELEASE_HEAD_READ) then redis.call("DEL", MAIN) end
  return KEPT or 0
end
