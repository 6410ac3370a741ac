-- Compare-and-set of one stored document.
--
-- KEYS[1]  the document's hash (fields: v = version, body = JSON)
-- ARGV[1]  the version the caller expects to replace (0: the document must not exist)
-- ARGV[2]  the new body (already carrying version ARGV[1] + 1)
-- ARGV[3]  the writer's fencing token, or 0 when fencing is not enforced
--
-- Reply: the new version; -1 when the stored version is not the expected one;
--        -2 when a write with a higher fencing token was already stored.
local token = tonumber(ARGV[3])
local highest = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if token > 0 and token < highest then
  return -2
end
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if current ~= tonumber(ARGV[1]) then
  return -1
end
redis.call('HSET', KEYS[1], 'v', current + 1, 'body', ARGV[2])
if token > highest then
  redis.call('HSET', KEYS[1], 'fence', token)
end
return current + 1
