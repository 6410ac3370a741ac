-- Acquire a session-turn lock and issue the next fencing token in one round trip.
--
-- KEYS[1]  the lock key            (<prefix>session:<id>:<turn>)
-- KEYS[2]  the session's fencing counter (<prefix>fence:<id>)
-- ARGV[1]  the owner token (random per grant)
-- ARGV[2]  the lease in milliseconds
-- ARGV[3]  how long the fencing counter outlives its last grant, in milliseconds
--
-- Reply: {1, fencing_token} when granted;
--        {0, pttl}          when another owner holds it (pttl: its remaining lease, ms).
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, token}
end
return {0, redis.call('PTTL', KEYS[1])}
