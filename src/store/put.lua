-- Compare-and-set of one stored document.
--
-- KEYS[1]  the document's hash (fields: v = version, body = JSON)
-- ARGV[1]  the version the caller expects to replace (0: the document must not exist)
-- ARGV[2]  the new body (already carrying version ARGV[1] + 1)
--
-- Reply: the new version; -1 when the stored version is not the expected one.
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if current ~= tonumber(ARGV[1]) then
  return -1
end
redis.call('HSET', KEYS[1], 'v', current + 1, 'body', ARGV[2])
return current + 1
