-- KEYS[1] record. ARGV: token, now, lease (µs), for a checkpoint the recovery point to
-- record, then grace_ms (last: common.lua's ttl_ms reads it there). Returns 1 or 0; a repeat
-- just extends the lease again. (Runs after common.lua.)
local r = redis.pcall('HMGET', KEYS[1], 'tok', 'st', 'ea')
if r.err or r[1] ~= ARGV[1] or r[2] ~= 'in_progress' then return 0 end
local expires = tonumber(r[3])
if not expires then return 0 end
local now = clock(ARGV[2])
local lease_end = now + ARGV[3]
if lease_end > expires then expires = lease_end end
if #ARGV == 5 then
  redis.call('HSET', KEYS[1], 'le', us(lease_end), 'ua', us(now), 'ea', us(expires), 'rp', ARGV[4])
else
  redis.call('HSET', KEYS[1], 'le', us(lease_end), 'ua', us(now), 'ea', us(expires))
end
redis.call('PEXPIRE', KEYS[1], ttl_ms(expires, now))
return 1
