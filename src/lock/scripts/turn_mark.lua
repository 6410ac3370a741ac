-- Raise the highest accepted turn of a session served in serialize mode (no document to
-- read the stored turn from).
--
-- KEYS[1]  the session's turn mark (<prefix>turn:<id>)
-- ARGV[1]  the turn just accepted
--
-- Reply: the mark after the update.
local mark = tonumber(redis.call('GET', KEYS[1]) or '0')
local turn = tonumber(ARGV[1])
if turn > mark then
  redis.call('SET', KEYS[1], turn)
  return turn
end
return mark
