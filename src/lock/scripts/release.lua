-- Release a lock only if this owner still holds it, and wake the waiters. The records of
-- what was committed under the lock (idempotency results, version snapshots) are stored first,
-- in the same round trip, so nobody can take the lock before they exist; so is what the store
-- did with the writes made under the document's commit slot, and the slot is given back with
-- the lock (see `slot_take.lua`): the commit costs no round trip of its own.
--
-- KEYS[1]      the lock key
-- KEYS[2]      the document's commit slot   (when ARGV[4] is not '')
-- KEYS[3]      the document's turn mark     (when ARGV[4] is not '')
-- KEYS[r..n]   records to store (optional; r is 4 with a slot, 2 without)
-- ARGV[1]      the owner token given at grant
-- ARGV[2]      the channel the release is announced on
-- ARGV[3]      'SPUBLISH' to announce on the session's shard (Redis Cluster); 'PUBLISH' otherwise
-- ARGV[4]      the commit slot: '' none held; 'give' give it back; 'keep' leave it to expire
--              by itself (a write whose outcome is unknown may still land)
-- ARGV[5]      the turn the store just accepted; -1 for none; -2 when the store deleted the
--              document (its turn mark goes with it: the next write starts a new life)
-- ARGV[6]      how long the turn mark outlives its last write, in milliseconds
-- ARGV[7]      '1' when sent again after a cut connection: the first sending may have run,
--              and another writer may have taken the slot and moved the mark since; the mark
--              is then changed only while the slot is still this owner's
-- ARGV[8..]    for each record, in the order of KEYS[r..n]: its value, its TTL in ms, the
--              value it must still hold to be changed ('' for none: stored unconditionally),
--              and '1' when only its TTL is set anew (value and expected value unused).
--              An empty value deletes the record (when it holds the expected value).
--
-- Reply: {lock, slot}: lock 1 released, 0 not held by this owner (expired, or taken over);
-- slot 1 given back (or kept, or none held), 0 it had expired (or been taken) before this
-- release: the write ran longer than the slot lived, and may have been overtaken. The records
-- and the turn mark are stored either way: they describe writes the store has confirmed.
local first = 2
local slot = 1
if ARGV[4] ~= '' then
  first = 4
  local holder = redis.call('GET', KEYS[2])
  if ARGV[7] ~= '1' or holder == ARGV[1] then
    local turn = tonumber(ARGV[5])
    if turn == -2 then
      redis.call('DEL', KEYS[3])
    elseif turn >= 0 then
      local mark = tonumber(redis.call('GET', KEYS[3]) or '-1')
      if turn > mark then
        redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[6])
      else
        redis.call('PEXPIRE', KEYS[3], ARGV[6])
      end
    end
  end
  if ARGV[4] == 'give' then
    if holder == ARGV[1] then
      redis.call('DEL', KEYS[2])
    else
      slot = 0
    end
  end
end
for i = first, #KEYS do
  local base = 8 + 4 * (i - first)
  local value, ttl, expect = ARGV[base], ARGV[base + 1], ARGV[base + 2]
  if ARGV[base + 3] == '1' then
    redis.call('PEXPIRE', KEYS[i], ttl)
  elseif expect == '' or redis.call('GET', KEYS[i]) == expect then
    if value == '' then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], value, 'PX', ttl)
    end
  end
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3] == 'SPUBLISH' and 'SPUBLISH' or 'PUBLISH', ARGV[2], '1')
  return {1, slot}
end
return {0, slot}
