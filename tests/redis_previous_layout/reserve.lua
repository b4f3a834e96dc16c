-- KEYS[1] record. ARGV: now, lease, lease + ttl (µs), lease + ttl + grace (ms), fingerprint,
-- principal, operation, key, nonce. Answers, for the caller to decode (_codec.reservation):
--   token                     acquired, an integer reply (the common case, the shortest)
--   {1, token, point}         acquired again (the nonce), with its recovery point
--   {1, token, point, 1}      acquired by taking over an attempt whose lease ended
--   {3, st, tok, resp, ca, ua, ea, rp}      a replay: a settled record with this fingerprint
--   {0, now, fp, st, tok, le, resp, ca, ua, ea, rp}   a record to judge at ``now``
--   {2, why}                  the key holds nothing idempo can read
-- Fields are answered by position, without names or the scope the caller knows (a replay's
-- reply is parsed in Python, where every element costs too).
--
-- A token is max(old token + 1, Redis's clock in µs): it grows on a takeover, and a record
-- created after the last one was deleted (released, purged, expired, evicted) still starts
-- past every token the key had, as long as Redis's clock does not step back.
--
-- The nonce is the caller's, new for each reserve: redis-py re-sends a command whose
-- connection broke, and a re-sent reserve that finds its own reservation gets it back instead
-- of reporting the key in progress. release.lua deletes a reservation by its nonce too.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
end
local created = false
local point = false
local old = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  local r = redis.pcall('HMGET', KEYS[1], 'fp', 'st', 'tok', 'resp', 'ca', 'ua', 'ea', 'rp')
  if r.err then return {2, r.err} end
  local st, ea = r[2], tonumber(r[7])
  if not (ea and r[1] and r[3] and (st == 'in_progress' or st == 'completed' or st == 'failed'))
  then
    return {2, 'fields missing or malformed'}
  end
  if ea > now then
    if st ~= 'in_progress' then
      if r[1] == ARGV[5] then return {3, st, r[3], r[4], r[5], r[6], r[7], r[8]} end
      return {0, now, r[1], st, r[3], false, r[4], r[5], r[6], r[7], r[8]}
    end
    local l = redis.call('HMGET', KEYS[1], 'le', 'n')
    local le = tonumber(l[1])
    if not le then return {2, 'an in-progress record without a lease'} end
    if l[2] == ARGV[9] then return {1, r[3], r[8]} end
    if r[1] ~= ARGV[5] or le > now then
      return {0, now, r[1], st, r[3], l[1], r[4], r[5], r[6], r[7], r[8]}
    end
    created = r[5]
    point = r[8]
  end
  old = tonumber(r[3])
  if not old then return {2, 'fields missing or malformed'} end
  redis.call('DEL', KEYS[1])
end
local token = now
if ARGV[1] ~= '' then
  local t = redis.call('TIME')
  token = t[1] * 1000000 + t[2]
end
if old and old >= token then token = old + 1 end
local stamp = ARGV[1]
if stamp == '' then stamp = string.format('%d', now) end
local tok = stamp
if token ~= now then tok = string.format('%d', token) end
redis.call('HSET', KEYS[1], 'p', ARGV[6], 'o', ARGV[7], 'k', ARGV[8], 'fp', ARGV[5],
  'st', 'in_progress', 'tok', tok, 'le', string.format('%d', now + ARGV[2]),
  'ca', created or stamp, 'ua', stamp, 'ea', string.format('%d', now + ARGV[3]), 'n', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if point then redis.call('HSET', KEYS[1], 'rp', point) end
if created then return {1, tok, point, 1} end
return token
