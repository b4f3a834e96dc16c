-- KEYS[1] record. Evicts the record whatever its state: it becomes a tombstone that keeps
-- its token until its retention ends (the next reservation's token still grows past it);
-- a key that holds nothing idempo can read is deleted. Answers 1 if there was a record.
local key = KEYS[1]
local v = redis.pcall('GET', key)
if type(v) == 'table' then
  v = upgrade(key, clock(''))
  if not v then return redis.call('DEL', key) end
end
if not v then return 0 end
local r = parse(v, true)
-- A tombstone must expire: a record without its expiry is deleted instead.
if not (r and derive(r, key)) or redis.call('PTTL', key) < 0 then return redis.call('DEL', key) end
if r.st == 'x' then return 0 end
redis.call('SET', key, tombstone(v), 'KEEPTTL')
return 1
