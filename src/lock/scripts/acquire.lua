-- Acquire a session-turn lock and issue the next fencing token in one round trip, in a fair
-- order across proxies: waiters take tickets, and only the oldest live one may take a free lock.
-- With the lock, the grant takes the commit slot of the document the writer is about to read
-- (see `slot_take.lua`) and reads its turn mark: an uncontended write needs no other command
-- before its read.
--
-- KEYS[1]  the lock key                 (<prefix>session:{<id>}:<turn>)
-- KEYS[2]  the session's fencing counter (<prefix>session:{<id>}:fence)
-- KEYS[3]  the lock's waiters, by ticket (a sorted set; score: when the waiter first asked)
-- KEYS[4]  the lock's waiters, by when they stop counting (score: ms on Redis's clock)
-- KEYS[5]  (optional) the document's commit slot (<prefix>session:{<id>}:d<scope>:slot)
-- KEYS[6]  (with KEYS[5]) the document's turn mark (<prefix>session:{<id>}:d<scope>:turn)
-- ARGV[1]  the owner token (random per grant)
-- ARGV[2]  the lease in milliseconds
-- ARGV[3]  how long the fencing counter (and a turn mark) outlives its last grant, in ms
-- ARGV[4]  the waiter's id (one per leader of a queue of writes, kept while it waits)
-- ARGV[5]  how long a waiter keeps its ticket without asking again, in milliseconds
-- ARGV[6]  (with KEYS[5]) how long the commit slot lives, in milliseconds
--
-- A waiter that stops asking (it gave up, or its process died) loses its ticket after
-- ARGV[5]: it cannot hold the lock back longer than that.
--
-- The token is the larger of the counter + 1 and Redis's clock in microseconds, so it keeps
-- growing when the counter is lost (Redis restarted without persistence, a failover to a
-- replica that missed it, expiry): a store that enforces fencing tokens never sees a lower
-- one. Tokens stay below 2^53 (exact in Lua and in JSON) until the year 2255.
--
-- Reply: {1, fencing_token}             granted (no slot asked for);
--        {1, fencing_token, 1, mark}    granted, and the commit slot taken (mark: the
--                                       document's turn mark, 0 when none);
--        {1, fencing_token, -1, pttl}   granted, but another writer's commit of the document
--                                       is in flight (pttl: the slot's remaining life, ms);
--        {0, pttl}                      another owner holds it (pttl: its remaining lease,
--                                       ms), or it is free but an older waiter's turn (pttl: 1).
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local millis = math.floor(micros / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', millis)
if #gone > 0 then
  redis.call('ZREM', KEYS[3], unpack(gone))
  redis.call('ZREM', KEYS[4], unpack(gone))
end
local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
if (not head or head == ARGV[4]) and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if head then
    redis.call('ZREM', KEYS[3], ARGV[4])
    redis.call('ZREM', KEYS[4], ARGV[4])
  end
  local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
  if micros > token then
    token = micros
  end
  redis.call('SET', KEYS[2], string.format('%d', token), 'PX', ARGV[3])
  if not KEYS[5] then
    return {1, token}
  end
  if redis.call('GET', KEYS[5]) then
    -- Another owner's: this owner's token is new.
    return {1, token, -1, redis.call('PTTL', KEYS[5])}
  end
  redis.call('SET', KEYS[5], ARGV[1], 'PX', ARGV[6])
  local mark = redis.call('GET', KEYS[6])
  if mark then
    redis.call('PEXPIRE', KEYS[6], ARGV[3])
  end
  return {1, token, 1, tonumber(mark or '0')}
end
redis.call('ZADD', KEYS[3], 'NX', millis, ARGV[4])
redis.call('ZADD', KEYS[4], millis + tonumber(ARGV[5]), ARGV[4])
redis.call('PEXPIRE', KEYS[3], 2 * tonumber(ARGV[5]))
redis.call('PEXPIRE', KEYS[4], 2 * tonumber(ARGV[5]))
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 1 then
  pttl = 1
end
return {0, pttl}
