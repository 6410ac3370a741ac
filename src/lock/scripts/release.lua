-- Release a lock only if this owner still holds it, and wake the waiters.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token given at grant
-- ARGV[2]  the channel the release is announced on
--
-- Reply: 1 released; 0 not held by this owner (expired, or taken over).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '1')
  return 1
end
return 0
