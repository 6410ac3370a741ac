-- Delete one stored document if it is at the expected version.
--
-- KEYS[1]  the document's hash
-- ARGV[1]  the expected version, or '' for any
--
-- Reply: 1 deleted; 0 absent; -1 version mismatch.
local current = redis.call('HGET', KEYS[1], 'v')
if not current then
  return 0
end
if ARGV[1] ~= '' and tonumber(current) ~= tonumber(ARGV[1]) then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
