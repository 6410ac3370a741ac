-- Extend a lease only if this owner still holds it.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token given at grant
-- ARGV[2]  the new lease in milliseconds
--
-- Reply: 1 renewed; 0 not held by this owner (the lease was lost).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
