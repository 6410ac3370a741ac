-- Acquire a session-turn lock and issue the next fencing token in one round trip.
--
-- KEYS[1]  the lock key                 (<prefix>session:{<id>}:<turn>)
-- KEYS[2]  the session's fencing counter (<prefix>session:{<id>}:fence)
-- ARGV[1]  the owner token (random per grant)
-- ARGV[2]  the lease in milliseconds
-- ARGV[3]  how long the fencing counter outlives its last grant, in milliseconds
--
-- The token is the larger of the counter + 1 and Redis's clock in microseconds, so it keeps
-- growing when the counter is lost (Redis restarted without persistence, a failover to a
-- replica that missed it, expiry): a store that enforces fencing tokens never sees a lower
-- one. Tokens stay below 2^53 (exact in Lua and in JSON) until the year 2255.
--
-- Reply: {1, fencing_token} when granted;
--        {0, pttl}          when another owner holds it (pttl: its remaining lease, ms).
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local now = redis.call('TIME')
  local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
  if micros > token then
    token = micros
  end
  redis.call('SET', KEYS[2], string.format('%d', token), 'PX', ARGV[3])
  return {1, token}
end
return {0, redis.call('PTTL', KEYS[1])}
