-- KEYS[1] record. ARGV: token, status, response, now, ttl (µs), ttl + grace (ms). Returns 1
-- or 0. Settling again with the same token, status and response succeeds without a change:
-- that is redis-py re-sending a settle whose reply the connection lost, or the caller
-- retrying it.
local r = redis.pcall('HMGET', KEYS[1], 'tok', 'st', 'ea', 'resp')
if r.err or r[1] ~= ARGV[1] then return 0 end
if r[2] ~= 'in_progress' then
  if r[2] == ARGV[2] and r[4] == ARGV[3] then return 1 end
  return 0
end
local expires = tonumber(r[3])
if not expires then return 0 end
local stamp = ARGV[4]
local now
if stamp == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
  stamp = string.format('%d', now)
else
  now = tonumber(stamp)
end
local wanted = now + ARGV[5]
-- The key's TTL already ends a grace period after 'ea' (every write of 'ea' sets it), so
-- only a longer retention needs a new one.
if wanted > expires then
  redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', stamp,
    'ea', string.format('%d', wanted))
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
else
  redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3], 'ua', stamp)
end
return 1
