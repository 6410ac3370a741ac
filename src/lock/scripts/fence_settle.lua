-- Settle a version reservation after the store answered.
--
-- KEYS[1]  the session's committed version (<prefix>version:<id>)
-- KEYS[2]  the session's in-flight reservation (<prefix>version:<id>:pending)
-- ARGV[1]  the owner token that reserved
-- ARGV[2]  the version now stored, or 0 when the write did not land
--
-- Reply: 1 (always). The committed version only ever grows.
local stored = tonumber(ARGV[2])
if stored > 0 then
  local committed = tonumber(redis.call('GET', KEYS[1]) or '0')
  if stored > committed then
    redis.call('SET', KEYS[1], stored)
  end
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
return 1
