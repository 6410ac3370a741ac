-- Reserve the next document version before writing to a store that has no ETags.
-- This is turnlock's own version fence: writers of different turns hold different locks,
-- so the commit must be ordered here instead of by the store's If-Match.
--
-- KEYS[1]  the lock key this writer holds
-- KEYS[2]  the session's committed version (<prefix>version:<id>)
-- KEYS[3]  the session's in-flight reservation (<prefix>version:<id>:pending)
-- ARGV[1]  the owner token of the lock
-- ARGV[2]  the version this writer read from the store
-- ARGV[3]  the lease in milliseconds (a reservation lives no longer than the lease)
--
-- Reply:  1 reserved;
--         0 the lock is no longer held by this owner (do not write);
--        -1 a newer version was committed since the read (read again);
--        -2 another writer's reservation is in flight (retry shortly).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local committed = tonumber(redis.call('GET', KEYS[2]) or '0')
if committed > tonumber(ARGV[2]) then
  return -1
end
local pending = redis.call('GET', KEYS[3])
if pending and pending ~= ARGV[1] then
  return -2
end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
return 1
