-- Give a document's commit slot back once the store answered, raising the turn mark when the
-- store accepted a serialized write.
--
-- KEYS[1]  the document's commit slot
-- KEYS[2]  the document's turn mark
-- ARGV[1]  the owner token that took the slot; empty to raise the mark only and keep the
--          slot (a write whose outcome is unknown: the slot expires by itself)
-- ARGV[2]  the turn the store just accepted; -1 for none; -2 when the store deleted the
--          document (its turn mark goes with it: the next write starts a new life)
-- ARGV[3]  how long the turn mark outlives its last write, in milliseconds
--
-- Reply: 1 released; 0 the slot had expired (or been taken) before this release: the write
-- ran longer than the slot lived, and may have been overtaken. The mark is raised either way:
-- it describes a write the store accepted.
local turn = tonumber(ARGV[2])
if turn == -2 then
  redis.call('DEL', KEYS[2])
elseif turn >= 0 then
  local mark = tonumber(redis.call('GET', KEYS[2]) or '-1')
  if turn > mark then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  else
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
