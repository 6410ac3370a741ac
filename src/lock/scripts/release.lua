-- Release a lock only if this owner still holds it, and wake the waiters. The records of
-- what was committed under the lock (idempotency results, version snapshots) are stored first,
-- in the same round trip, so nobody can take the lock before they exist.
--
-- KEYS[1]      the lock key
-- KEYS[2..n]   records to store (optional)
-- ARGV[1]      the owner token given at grant
-- ARGV[2]      the channel the release is announced on
-- ARGV[3..]    for each record, in the order of KEYS[2..n]: its value, its TTL in ms, and the
--              value it must still hold to be changed ('' for none: stored unconditionally).
--              An empty value deletes the record (when it holds the expected value).
-- ARGV[3n]     (after the records, optional) 'SPUBLISH' to announce on the session's shard
--              (Redis Cluster); PUBLISH otherwise.
--
-- Reply: 1 released; 0 not held by this owner (expired, or taken over). The records are
-- stored either way: they describe writes the store has already confirmed.
for i = 2, #KEYS do
  local base = 3 * (i - 1)
  local value, ttl, expect = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  if expect == '' or redis.call('GET', KEYS[i]) == expect then
    if value == '' then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], value, 'PX', ttl)
    end
  end
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3 * #KEYS] == 'SPUBLISH' and 'SPUBLISH' or 'PUBLISH', ARGV[2], '1')
  return 1
end
return 0
