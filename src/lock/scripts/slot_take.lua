-- Take (or extend) a document's commit slot before reading it, and read its turn mark.
-- Writers of different turns hold different locks; the slot orders their commits of one
-- document: it is held from the read until the store answered the write, and lives at least
-- as long as a write-back can take (the store timeout plus a lease), so a slow write-back is
-- never overtaken. A holder that vanished leaves it to expire.
--
-- A grant takes the slot with the lock (`acquire.lua`) and gives it back with the lock
-- (`release.lua`); this script is for the rest: a grant that found another writer's commit in
-- flight, and a holder extending its slot when a read took long.
--
-- KEYS[1]  the lock key this writer holds
-- KEYS[2]  the document's commit slot   (<prefix>session:{<id>}:d<scope>:slot)
-- KEYS[3]  the document's turn mark     (<prefix>session:{<id>}:d<scope>:turn)
-- ARGV[1]  the owner token of the lock
-- ARGV[2]  how long the slot lives, in milliseconds
-- ARGV[3]  how long the turn mark outlives its last write, in milliseconds
--
-- Reply: {1, turn_mark}  taken (or extended) by this owner;
--        {0, 0}          the lock is no longer held by this owner (do not write);
--        {-1, pttl}      another writer's commit is in flight (pttl: its remaining life, ms).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0, 0}
end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then
  return {-1, redis.call('PTTL', KEYS[2])}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
local mark = redis.call('GET', KEYS[3])
if mark then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
return {1, tonumber(mark or '0')}
